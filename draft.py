"""The EAGLE-3 draft: one decoder layer over the policy's tapped hidden states, trained by multi-pass TTT.

    h^0_i = fc([f_low; f_mid; f_high]_i)                                 (K taps of the policy at position i, K*H -> H)
    h^d_i = Layer(x = [norm(e(x_{i+d})); norm(h^{d-1}_i)],  residual h^{d-1}_i,  RoPE position i+d-1)
    q^d_i = softmax(W_head norm(h^d_i))                    -> predicts x_{i+d+1}; teacher p_{i+d} (the policy at i+d)

Training (draft_ttt.py): training-time test (TTT, EAGLE-3 [Li et al. 2025]) unrolls the draft for d = 1..P passes on
every anchor i at once, each pass attending to the trunk (pass-1 keys of the sequence) and its own branch, through
`attention_cp.ring_branch_attention` (so it runs under context parallelism too). Loss: L = sum_d w_d * mean_i
CE(p_{i+d}, q^d_i), streamed by draft_loss.py; metrics per pass and the predicted acceptance length tau_hat.

Inference (speculative.py): `extend` appends trunk entries (token after position j, taps at j) to the draft's own KV
cache and returns the pass-1 state at a chosen anchor; each `step` is one more pass (one cache entry on the branch).

    python draft.py            # TTT learning (~15 s): a draft trained on a tiny policy's own samples, its predicted
                               # acceptance length tau_hat before and after, then its proposals

Letters: T packed tokens, S sequences, B batch rows, N new entries per row, H hidden, K taps, Hq/Hkv heads, D head dim,
V target vocab, Vd draft vocab, P branch entries.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import draft_ttt
from drafter import propose_chain
from serving.draft_checkpoint import read_draft, write_draft
from serving.draft_vocab import maps as draft_vocab_maps
from model import EMBED_TAP, ModelConfig, Transformer, check_tap_layers, default_tap_layers
from modeling.kv_cache import KVCache
from modeling.layers import MLP, Attention, RMSNorm, rope_cos_sin


@dataclass
class DraftConfig:
    vocab_size: int  # the target's vocabulary V (proposals are target ids)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tap_layers: tuple  # policy layers whose outputs feed fc (EMBED_TAP excluded: the draft embeds tokens itself)
    target_num_layers: int
    draft_vocab_size: Optional[int] = None  # None -> the full target vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096  # the target's (the serving config must cover its context)

    def __post_init__(self):
        self.tap_layers = check_tap_layers(self.tap_layers, self.target_num_layers)
        if not self.tap_layers or EMBED_TAP in self.tap_layers:
            raise ValueError(f"tap_layers={self.tap_layers}: expected >= 1 policy layer id and not the embeddings "
                             f"({EMBED_TAP})")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: expected 1..vocab_size={self.vocab_size}")

    def layer_config(self) -> ModelConfig:  # the one decoder layer, as a Llama layer (reuses model.py's blocks)
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)


class DraftLayer(nn.Module):
    """EAGLE-3's decoder layer: q/k/v read [norm(e); norm(h)] (2H); the residual stream is h alone."""

    def __init__(self, lcfg: ModelConfig):
        super().__init__()
        H = lcfg.hidden_size
        self.input_layernorm = RMSNorm(H, lcfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, lcfg.rms_norm_eps)  # on the incoming hidden
        self.self_attn = Attention(lcfg)
        a = self.self_attn
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(2 * H, m.out_features, bias=False)
                                        for m in (a.q_proj, a.k_proj, a.v_proj))
        self.post_attention_layernorm = RMSNorm(H, lcfg.rms_norm_eps)
        self.mlp = MLP(lcfg)

    def forward(self, e, h, attend):  # e, h (..., H); attend: (..., 2H) -> (..., H) attention output
        h = h + attend(torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """Parameter names follow the EAGLE-3 checkpoints (fc, midlayer.*, norm, lm_head, d2t, t2d)."""

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.cfg, H, K = cfg, cfg.hidden_size, len(cfg.tap_layers)
        self.lcfg = cfg.layer_config()
        self.fc = nn.Linear(K * H, H, bias=False)
        self.midlayer = DraftLayer(self.lcfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # draft id v <-> target id v + d2t[v] (EAGLE-3 stores offsets); t2d marks target ids the draft can propose
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.apply(Transformer._init)
        self.attach(embed_weight)

    # -- construction ----------------------------------------------------------------------------------------------
    def attach(self, embed):
        """Share the policy's input embedding (a Transformer, an nn.Embedding or its weight). It is held detached:
        frozen for the draft, yet in-place updates of the policy show through. Call again after re-assembling the
        policy (new tensors) or after `draft.to(...)` (which copies buffers). Not part of the draft's checkpoint."""
        w = _embed_weight(embed)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"embed: expected an embedding of shape ({self.cfg.vocab_size}, {self.cfg.hidden_size}), "
                             f"got {None if not isinstance(w, torch.Tensor) else tuple(w.shape)}")
        self.register_buffer("embed_weight", w.detach(), persistent=False)

    @classmethod
    def from_target(cls, target: Transformer, *, tap_layers=None, draft_vocab=None, intermediate_size=None,
                    embed=None) -> "Eagle3Draft":
        """A draft matched to `target`: its head config, taps (default `default_tap_layers(n)`), LM head and final norm
        copied from the policy's (rows of `draft_vocab`, a 1-D tensor of target ids, when the vocabulary is reduced:
        draft_vocab.select_draft_vocab picks them),
        the embedding shared (`embed` overrides it on a pipeline stage that lacks one)."""
        if not target.is_last:
            raise ValueError("target: needs the last pipeline stage (the LM head initialises the draft's)")
        c = target.cfg
        taps = default_tap_layers(c.num_hidden_layers) if tap_layers is None else tuple(tap_layers)
        ids = None
        if draft_vocab is not None:
            ids = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
            bad = ids.numel() == 0 or ids.unique().numel() != ids.numel()
            if bad or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
                raise ValueError(f"draft_vocab: expected distinct target ids in [0, {c.vocab_size})")
            ids = ids.sort().values
        cfg = DraftConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                          intermediate_size=intermediate_size or c.intermediate_size,
                          num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                          head_dim=c.head_dim, tap_layers=taps, target_num_layers=c.num_hidden_layers,
                          draft_vocab_size=None if ids is None else ids.numel(), rms_norm_eps=c.rms_norm_eps,
                          rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings)
        embed = target if embed is None else embed
        if isinstance(embed, Transformer) and not hasattr(embed.model, "embed_tokens"):
            raise ValueError("embed: this pipeline stage has no input embedding; pass the policy's embedding weight")
        p = next(target.parameters())
        draft = cls(cfg, embed).to(device=p.device, dtype=p.dtype)
        draft.attach(embed)  # .to() may have copied the shared buffer; share it again
        with torch.no_grad():
            w = target.head_weight  # (V, H)
            draft.norm.weight.copy_(target.model.norm.weight)
            if ids is None:
                draft.lm_head.weight.copy_(w)
            else:
                draft.lm_head.weight.copy_(w[ids])
                d2t, t2d = draft_vocab_maps(ids.to(p.device), c.vocab_size)
                draft.d2t.copy_(d2t)
                draft.t2d.copy_(t2d)
        return draft

    max_draft_tokens = None  # drafter.py: a chain drafter (any k, tree drafts, adaptive k)

    def fresh(self, policy) -> "Eagle3Draft":  # drafter.py: untrained, the same taps and draft vocabulary
        reduced = self.cfg.draft_vocab_size < self.cfg.vocab_size
        return Eagle3Draft.from_target(policy, tap_layers=self.tap_layers,
                                       draft_vocab=self.draft_to_target if reduced else None)

    # -- the shared pieces -----------------------------------------------------------------------------------------
    @property
    def tap_layers(self) -> tuple:
        return self.cfg.tap_layers

    @property
    def draft_to_target(self) -> torch.Tensor:  # (Vd,) target id of each draft id
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, tokens):  # (...) target ids -> (..., H), no gradient into the shared embedding
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def features(self, taps: dict):  # {layer: (..., H)} -> h^0 (..., H)
        missing = [l for l in self.tap_layers if l not in taps]
        if missing:
            raise ValueError(f"taps: missing layers {missing}; the draft reads {self.tap_layers}")
        return self.fc(torch.cat([taps[l].to(self.fc.weight.dtype) for l in self.tap_layers], dim=-1))

    def logits(self, h):  # (..., H) -> (..., Vd) over the draft vocabulary
        return self.lm_head(self.norm(h))

    def target_logits(self, h):  # (..., H) -> (..., V): -inf on target ids outside the draft vocabulary
        z = self.logits(h)
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return z
        full = z.new_full(z.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target, z)

    # -- inference: the draft's own KV cache -----------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, block: int = None) -> KVCache:  # grown in blocks (kv_cache.py)
        return KVCache(self.lcfg, batch, max_len, layers=[0], dtype=self.fc.weight.dtype, device=self.fc.weight.device,
                       block=block)

    def _cached(self, cache: KVCache, e, h, tree=None):  # e, h (B, N, H) -> (B, N, H), N entries appended per row
        N = e.shape[1]
        pos = cache.begin(N, tree)  # (B, N)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype, bound=cache.key_len)
        attn = self.midlayer.self_attn
        h = self.midlayer(e, h, lambda x: attn.forward_cached(x, cos, sin, cache, 0))
        cache.commit()
        return h

    def extend(self, cache: KVCache, tokens, taps: dict, last):
        """Append trunk entries: entry j of row b = (e(tokens[b, j]), fc(taps[b, j])), where tokens[b, j] is the token
        that *follows* the tapped position. Row b keeps entries 0..last[b] (the rest roll back); returns the pass-1
        state at entry last[b]: h (B, H) and target-vocab logits (B, V) predicting the token after tokens[b, last[b]].

        tokens (B, N), taps {layer: (B, N, H)}, last (B,) long."""
        L0 = cache.lengths.clone()  # commit() advances lengths in place
        h = self._cached(cache, self.embed(tokens), self.features(taps))  # (B, N, H)
        h = h[torch.arange(h.shape[0], device=h.device), last]  # (B, H)
        cache.rollback(L0 + last + 1)
        return h, self.target_logits(h)

    def propose(self, cache: KVCache, state, k: int, temperature: float, generator=None):
        """drafter.py: k tokens from the state (h, zq) at the last verified position, one `step` per further token
        (k - 1 forwards on the branch), the cache rolled back afterwards -> d (B, k), q (B, k, V) or None."""
        L, bound = cache.lengths.clone(), cache.bound  # bound: the host's, restored with the lengths
        d, q = propose_chain(lambda t, h: self.step(cache, t, h), *state, k, temperature, generator)
        cache.rollback(L, bound=bound)
        return d, q

    def step(self, cache: KVCache, tokens, h):
        """One more pass at every row's anchor: tokens (B,) the previous pass's proposal, h (B, H) its state."""
        h = self._cached(cache, self.embed(tokens)[:, None], h[:, None])[:, 0]
        return h, self.target_logits(h)

    def tree_step(self, cache: KVCache, tokens, h, tree):
        """One level of a draft tree (speculative_tree.py): tokens (B, N) the level's nodes, h (B, N, H) their parents'
        states, tree the level's kv_cache.TreeNodes (KVCache.begin_nodes) -> h (B, N, H), target-vocab logits (B, N, V).
        """
        h = self._cached(cache, self.embed(tokens), h, tree)
        return h, self.target_logits(h)

    # -- training: multi-pass TTT over packed (optionally zigzag-sharded) sequences (draft_ttt.py) ---------------------
    def ttt_forward(self, taps: dict, tokens, cu_seqlens, num_passes: int, **kw) -> list:
        """Passes 1..num_passes at every anchor -> [h^1, ..., h^P], each (T, H): draft_ttt.ttt_forward."""
        return draft_ttt.ttt_forward(self, taps, tokens, cu_seqlens, num_passes, **kw)

    def ttt_loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, **kw):
        """The multi-pass TTT loss on the policy's own forward -> (loss, metrics): draft_ttt.ttt_loss."""
        return draft_ttt.ttt_loss(self, taps, tokens, cu_seqlens, teacher_logits, **kw)

    def loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, **kw):  # drafter.py: the family's loss
        return self.ttt_loss(taps, tokens, cu_seqlens, teacher_logits, **kw)

    @staticmethod
    def loss_options(trainer) -> dict:  # drafter.py: TTT's passes and their weight decay, from a DraftTrainer
        return dict(num_passes=trainer.num_passes, pass_weight=trainer.pass_weight)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, path: str):
        """config.json + model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d; not the shared embedding)."""
        write_draft(path, dict(asdict(self.cfg), tap_layers=list(self.cfg.tap_layers),
                               architectures=[self.architecture]), self.state_dict())

    def export(self, path: str, *, dtype=torch.bfloat16, **kw):
        """The serving format vLLM's and SGLang's LlamaForCausalLMEagle3 load (export.py): config.json +
        model.safetensors, floats in `dtype`, written atomically. Needs exactly 3 taps, none on the last layer.
        kw: export_draft's (max_position_embeddings, pair)."""
        from serving.export import export_draft  # export.py reads a draft; the draft does not need it to train
        export_draft(self, path, dtype=dtype, **kw)

    def check_exportable(self):  # drafter.py: a ValueError when the engines cannot feed these taps
        from serving.export import check_exportable
        check_exportable(self.cfg.tap_layers, self.cfg.target_num_layers)

    @classmethod
    def load(cls, path: str, embed) -> "Eagle3Draft":
        """Load a draft saved by `save`; `embed` is the policy (or its embedding) whose embedding the draft shares."""
        raw, sd = read_draft(path)
        draft = cls(DraftConfig(**raw), embed).to(device=draft_device(embed), dtype=sd["fc.weight"].dtype)
        draft.load_state_dict(sd)
        draft.attach(embed)
        return draft

    # -- the family's facts (drafter.FAMILY): what the config, the memory plan and --draft ask of the class ---------
    kind = "chain"  # any k, tree drafts, adaptive k (drafter.py)
    architecture = "Eagle3DraftModel"  # config.json's architectures (save); a file without one is EAGLE-3's
    taps_rule = ("3 ascending layer ids in [0, the policy's layers - 2], e.g. --tap_layers=0,2,4: the served EAGLE-3 "
                 "draft (vLLM, SGLang) reads exactly 3 aux hidden states, none of them the last layer's output")

    @staticmethod
    def config_class():
        return DraftConfig

    @staticmethod
    def default_taps(n_layers: int, cfg) -> tuple:  # --tap_layers='': model.default_tap_layers
        return default_tap_layers(n_layers)

    @staticmethod
    def taps_ok(taps: tuple, n_layers: int) -> bool:  # ascending distinct ints: the served format's 3, below n - 1
        return len(taps) == 3 and 0 <= taps[0] and taps[-1] <= n_layers - 2

    @staticmethod
    def of_shape(m: ModelConfig, cfg, taps: tuple) -> "Eagle3Draft":  # the run's draft, to count (built on meta)
        dc = DraftConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                         head_dim=m.head_dim, tap_layers=taps, target_num_layers=m.num_hidden_layers,
                         draft_vocab_size=cfg.draft_vocab or None)
        return Eagle3Draft(dc, torch.empty(m.vocab_size, m.hidden_size))

    @staticmethod
    def cache_shape(cfg) -> tuple:  # the rollout's draft KV cache: (layers, slots beyond the policy's): one layer
        return 1, 0

    @staticmethod
    def act_bytes(size, cfg, T: float, n_taps: int, seqs: float) -> float:
        """Saved for backward over T tokens: each of the P TTT passes at every position, and fc's taps + h^0.
        size: harness/memory_model.Sizes (per-token bytes of the pieces)."""
        return T * (cfg.ttt_passes * size.draft_pass + (n_taps + 1) * size.H * size.b)

    @staticmethod
    def size_flags(cfg) -> str:  # the flag that sizes its copy: the head's rows
        return "--draft_vocab"

    @staticmethod
    def check_file(path: str, fmt: str):  # --draft in vLLM's format: read as the engines read it, before its fields
        from serving.export import check_export
        if fmt == "vllm":
            check_export(path)  # ENGINE_FIXED, d2t / t2d, dtype

    @classmethod
    def from_fields(cls, fields: dict, sd: dict, path: str, n_layers: int) -> tuple:
        """--draft in a served format (harness/draft_formats): (its config, its tensors). Its taps must be ones the
        engines feed (3, none the policy's last layer); identity d2t / t2d at a full draft vocabulary, where the file
        holds none."""
        from serving.export import check_exportable
        try:
            check_exportable(fields["tap_layers"], n_layers)
        except ValueError as e:
            raise ValueError(f"draft {path!r}: its taps do not fit the {n_layers}-layer policy: {e}") from None
        config = DraftConfig(**fields)
        Vd = config.draft_vocab_size
        sd["d2t"], sd["t2d"] = draft_vocab_maps(torch.arange(Vd) + sd["d2t"] if "d2t" in sd else torch.arange(Vd),
                                                config.vocab_size)
        return config, sd


def _embed_weight(embed):  # a Transformer, an nn.Embedding or its weight -> the (V, H) weight
    return embed.embed.weight if isinstance(embed, Transformer) else getattr(embed, "weight", embed)


def draft_device(embed) -> torch.device:  # where a draft sharing `embed` (see Eagle3Draft.attach) must live
    return _embed_weight(embed).device


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    from drafter import demo
    demo("EAGLE-3 (TTT, 3 passes)", Eagle3Draft.from_target, k=3, num_passes=3)
