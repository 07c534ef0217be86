"""The EAGLE-3 draft: one decoder layer over the policy's tapped hidden states, trained by multi-pass TTT.

    h^0_i = fc([f_low; f_mid; f_high]_i)                                 (K taps of the policy at position i, K*H -> H)
    h^d_i = Layer(x = [norm(e(x_{i+d})); norm(h^{d-1}_i)],  residual h^{d-1}_i,  RoPE position i+d-1)
    q^d_i = softmax(W_head norm(h^d_i))                    -> predicts x_{i+d+1}; teacher p_{i+d} (the policy at i+d)

Training-time test (TTT, EAGLE-3 [Li et al. 2025]) unrolls the draft for d = 1..P passes on every anchor i at once.
Pass d's query at anchor i attends to the *trunk* -- the pass-1 keys at positions j <= i of its sequence -- and to
its *branch* -- the keys of passes 2..d at anchor i (RoPE positions i+1..i+d-1). That is exactly the key set the draft
sees at inference after d-1 own steps from anchor i, so training matches inference; the attention is
`attention_cp.ring_branch_attention`, which also runs it under context parallelism (zigzag ring for the trunk, the
branch local). Loss: L = sum_d w_d * mean_i CE(p_{i+d}, q^d_i), w_d = pass_weight^(d-1) (0.8 unless --ttt_decay)
(soft CE = forward KL + const), streamed over token chunks by draft_loss.py (no (T, V) tensor kept; the teacher may be
the policy's hidden + LM head).
Metrics per pass: top-1 agreement with the teacher, that agreement given all earlier passes agreed, the expected
acceptance alpha_d = E sum_x min(p(x), q(x)), and the predicted acceptance length
tau_hat = 1 + sum_k prod_{j<=k} alpha_j.

Inference (speculative.py): `extend` appends trunk entries (token after position j, taps at j) to the draft's own KV
cache and returns the pass-1 state at a chosen anchor; each `step` is one more pass (one cache entry on the branch).

    python draft.py            # builds a draft for the `tiny` policy, prints its TTT loss and metrics, proposes tokens

Letters: T packed tokens, S sequences, B batch rows, N new entries per row, H hidden, K taps, Hq/Hkv heads, D head dim,
V target vocab, Vd draft vocab, P branch entries.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import branch_mask
from branch_mask import cp_shift, pad_ring_of_one, shift_packed, zigzag_shard
from draft_loss import chunk_rows, dense_pass_losses, make_teacher, pass_targets, ring_sum, streaming_pass_losses
from serving.draft_vocab import maps as draft_vocab_maps
from model import EMBED_TAP, ModelConfig, Transformer, check_tap_layers, default_tap_layers
from modeling.kv_cache import KVCache
from modeling.layers import MLP, Attention, RMSNorm, rope_cos_sin
from parallel.ring import as_ring


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
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.lcfg, batch, max_len, layers=[0], dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    def _cached(self, cache: KVCache, e, h, tree=None):  # e, h (B, N, H) -> (B, N, H), N entries appended per row
        N = e.shape[1]
        pos = cache.begin(N, tree)  # (B, N)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
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

    # -- training: multi-pass TTT over packed (optionally zigzag-sharded) sequences ----------------------------------
    def ttt_forward(self, taps: dict, tokens, cu_seqlens, num_passes: int, *, position_ids=None, group=None,
                    attn_fn=None, backend: str = "torch") -> list:
        """Passes 1..num_passes at every anchor -> [h^1, ..., h^P], each (T, H) (pre-norm; `logits(h)` gives q).

        taps {layer: (T, H)} (detached here: no draft gradient reaches the policy) and tokens (T,) are the packed batch,
        or this rank's zigzag shard of it under CP; cu_seqlens (S+1) the global boundaries (CP-padded under CP;
        without CP any lengths). group: None, a torch ProcessGroup or a ring.Ring. attn_fn defaults to
        attention_cp.ring_branch_attention (tests pass the dense oracle).

        taps[EMBED_TAP] (T, H), if given, is the policy's own input embedding e(x_i) (its first stage's tap, carried by
        TapChannel): e(x_{i+d}) is then that tap shifted by d rows (cp_shift: under CP only boundary rows travel)
        instead of a lookup in the shared embedding, so the update path needs no full policy copy. The two agree at
        every position that has a next token; past a sequence's end the shift fills zeros where the lookup embeds id
        0, and those positions carry no loss and are seen by no counted query."""
        if num_passes < 1:
            raise ValueError(f"num_passes={num_passes}: expected >= 1")
        ring = as_ring(group)
        taps = self._tap_inputs(taps, tokens.shape[0])
        pad = pad_ring_of_one(cu_seqlens) if ring.size == 1 else None  # under CP the caller has padded
        if pad is not None:  # cp = 1, odd lengths (branch_mask.pad_ring_of_one says why): pad, run, drop the padding
            hs = self.ttt_forward({l: pad.pad(t) for l, t in taps.items()}, pad.pad(tokens), pad.cu_seqlens,
                                  num_passes, position_ids=None if position_ids is None else pad.pad(position_ids),
                                  group=ring, attn_fn=attn_fn, backend=backend)
            return [pad.unpad(h) for h in hs]
        if attn_fn is None:
            from attention_cp import ring_branch_attention as attn_fn
        attn = self.midlayer.self_attn
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        pos = _local_positions(cu_seqlens, ring) if position_ids is None else position_ids.long()  # (T,)
        h = self.features(taps)  # h^0 (T, H)
        emb = taps[EMBED_TAP].to(h.dtype) if EMBED_TAP in taps else None  # (T, H) e(x_i), or None: look tokens up
        k1 = v1 = None
        branch_k, branch_v, hs = [], [], []
        for d in range(1, num_passes + 1):
            # 1. inputs: the token d positions ahead (CP-aware shift; past a sequence end -> id 0, masked in the loss)
            e = (self.embed(cp_shift(tokens, cu_seqlens, d, group=ring, fill=0)[0]) if emb is None
                 else cp_shift(emb, cu_seqlens, d, group=ring, fill=0)[0])  # (T, H) e(x_{i+d})
            cos, sin = rope_cos_sin(pos + (d - 1), self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
            x = torch.cat([self.midlayer.input_layernorm(e), self.midlayer.hidden_norm(h)], dim=-1)  # (T, 2H)
            q, k, v = attn.qkv(x, cos, sin)  # (T, Hq, D), (T, Hkv, D) x2
            # 2. trunk = pass-1 K/V; branch = K/V of passes 2..d at the same anchor (P = d-1, own key included)
            if d == 1:
                k1, v1, bk, bv = k, v, None, None
            else:
                branch_k.append(k)
                branch_v.append(v)
                bk, bv = torch.stack(branch_k, 1), torch.stack(branch_v, 1)  # (T, P, Hkv, D)
            o = attn_fn(q, k1, v1, cu_seqlens, bk, bv, group=ring, softmax_scale=scale, backend=backend)
            # 3. residual on the previous state (gradient kept through h^{d-1}), then the MLP
            h = h + attn.o_proj(o.flatten(-2))
            h = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
            hs.append(h)
        return hs

    def _tap_inputs(self, taps, T):
        missing = [l for l in self.tap_layers if l not in taps]
        if missing:
            raise ValueError(f"taps: missing layers {missing}; the draft reads {self.tap_layers}")
        keep = self.tap_layers + ((EMBED_TAP,) if EMBED_TAP in taps else ())  # the embedding tap: optional
        bad = [l for l in keep if tuple(taps[l].shape) != (T, self.cfg.hidden_size)]
        if bad:
            raise ValueError(f"taps: layers {bad} are not (T={T}, H={self.cfg.hidden_size})")
        return {l: taps[l].detach() for l in keep}

    def ttt_loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, *, teacher_hidden=None, teacher_head=None,
                 loss_mask=None, num_passes: int = 3, pass_weight: float = 0.8, hard_labels: bool = False,
                 position_ids=None, group=None, attn_fn=None, backend: str = "torch", chunk=None):
        """Multi-pass TTT loss on the policy's own forward. Returns (loss, metrics dict).

        The teacher is the policy at each position (predicting the next token): its logits teacher_logits (T, V), or
        -- no (T, V) tensor at all -- its final normed hidden teacher_hidden (T, H) with its LM-head weight
        teacher_head (V, H). loss_mask (T,) bool per prediction: row j's prediction of x_{j+1} counts (default: each row
        whose sequence has a next token; required under CP, false on the padding). Pass d at anchor i counts iff
        loss_mask[i+d]. Under CP every (T, ...) input is this rank's zigzag shard and the returned loss is this rank's
        share: the sum over ranks is the global loss, so the draft's grads are summed over the CP group (as data
        parallelism does). Metrics are global floats. chunk: rows per chunk of the streamed loss
        (draft_loss.StreamingSoftCE, O(chunk * V) memory; None: 2^21 // V rows); 0 runs the dense reference
        (draft_loss.dense_pass_losses, every (T, V) tensor materialised)."""
        ring = as_ring(group)
        T = tokens.shape[0]
        teacher = make_teacher(teacher_logits, teacher_hidden, teacher_head, T, self.cfg.vocab_size, cu_seqlens,
                               num_passes, ring)
        if loss_mask is None:
            if ring.size > 1:
                raise ValueError("loss_mask: required under CP (false on the padding)")
            loss_mask = shift_packed(tokens, cu_seqlens, 1)[1]  # (T,) a next token exists in the sequence
        elif loss_mask.shape != (T,):
            raise ValueError(f"loss_mask: expected shape ({T},), got {tuple(loss_mask.shape)}")
        pad = pad_ring_of_one(cu_seqlens) if ring.size == 1 else None
        if pad is not None:  # cp = 1, odd lengths: pad the (T, H) inputs; the teacher is read through a row map
            taps = {l: pad.pad(t) for l, t in self._tap_inputs(taps, T).items()}
            tokens, loss_mask, cu_seqlens = pad.pad(tokens), pad.pad(loss_mask.bool(), False), pad.cu_seqlens
            position_ids = None if position_ids is None else pad.pad(position_ids)
            teacher.row_map = pad.pad(torch.arange(T, device=tokens.device))
        hs = self.ttt_forward(taps, tokens, cu_seqlens, num_passes, position_ids=position_ids, group=ring,
                              attn_fn=attn_fn, backend=backend)
        valid, labels, count = pass_targets(tokens, cu_seqlens, loss_mask, num_passes, ring, hard_labels=hard_labels,
                                            t2d=self.t2d)
        labels = None if labels is None else [_to_draft_id(self, y) for y in labels]
        chunk = chunk_rows(self.cfg.vocab_size, chunk)
        if chunk == 0:
            shifted = lambda x, d, fill: cp_shift(x, cu_seqlens, d, group=ring, fill=fill)[0]  # noqa: E731
            loss, stats = dense_pass_losses(hs, self.logits, self.draft_to_target, teacher.dense(), valid, labels,
                                            count, pass_weight=pass_weight, shifted=shifted)
        else:
            full = self.cfg.draft_vocab_size == self.cfg.vocab_size
            loss, stats = streaming_pass_losses(hs, self.norm, self.lm_head.weight,
                                                None if full else self.draft_to_target, teacher, valid, labels, count,
                                                pass_weight=pass_weight, cp=ring.size, local_cu=cu_seqlens // ring.size,
                                                chunk=chunk)
        return loss, _metrics(ring_sum(stats, ring), count)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, path: str):
        """config.json + model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d; not the shared embedding)."""
        os.makedirs(path, exist_ok=True)
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        cfg = dict(asdict(self.cfg), tap_layers=list(self.cfg.tap_layers), architectures=["Eagle3DraftModel"])
        for name, write in (("model.safetensors", lambda f: save_file(sd, f, metadata={"format": "pt"})),
                            ("config.json", lambda f: open(f, "w").write(json.dumps(cfg, indent=2)))):
            tmp = os.path.join(path, f".{name}.tmp")
            write(tmp)
            os.replace(tmp, os.path.join(path, name))  # each file lands atomically

    def export(self, path: str, *, dtype=torch.bfloat16):
        """The serving format vLLM's and SGLang's LlamaForCausalLMEagle3 load (export.py): config.json +
        model.safetensors, floats in `dtype`, written atomically. Needs exactly 3 taps, none on the last layer."""
        from serving.export import export_draft  # export.py reads a draft; the draft does not need it to train
        export_draft(self, path, dtype=dtype)

    @classmethod
    def load(cls, path: str, embed) -> "Eagle3Draft":
        """Load a draft saved by `save`; `embed` is the policy (or its embedding) whose embedding the draft shares."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"path={path!r}: expected a draft directory with config.json")
        with open(cfg_path) as f:
            raw = json.load(f)
        raw.pop("architectures", None)
        cfg = DraftConfig(**raw)
        sd = load_file(os.path.join(path, "model.safetensors"))
        draft = cls(cfg, embed).to(device=draft_device(embed), dtype=sd["fc.weight"].dtype)  # the policy's device
        draft.load_state_dict(sd)
        draft.attach(embed)
        return draft


def _embed_weight(embed):  # a Transformer, an nn.Embedding or its weight -> the (V, H) weight
    return embed.embed.weight if isinstance(embed, Transformer) else getattr(embed, "weight", embed)


def draft_device(embed) -> torch.device:  # where a draft sharing `embed` (see Eagle3Draft.attach) must live
    return _embed_weight(embed).device


def _to_draft_id(draft: Eagle3Draft, y):  # (T,) target ids -> draft ids (0 where outside the draft vocabulary)
    if draft.cfg.draft_vocab_size == draft.cfg.vocab_size:
        return y
    inv = torch.zeros(draft.cfg.vocab_size, dtype=torch.long, device=y.device)
    inv[draft.draft_to_target] = torch.arange(draft.cfg.draft_vocab_size, device=y.device)
    return inv[y]


def _metrics(stats, count) -> dict:
    """stats (P, 5) summed over valid anchors: ce, agree, agree & all earlier agreed, all earlier agreed, alpha."""
    n = count.clamp_min(1)
    alpha = (stats[:, 4] / n).tolist()
    tau, run = 1.0, 1.0
    for a in alpha:  # tau_hat = 1 + sum_k prod_{j<=k} alpha_j
        run *= a
        tau += run
    return {"loss_per_pass": (stats[:, 0] / n).tolist(), "acc": (stats[:, 1] / n).tolist(),
            "acc_cond": (stats[:, 2] / stats[:, 3].clamp_min(1)).tolist(), "alpha": alpha, "tau_hat": tau,
            "count": [int(c) for c in count.tolist()]}


def _local_positions(cu_seqlens, ring):  # (T_local,) RoPE position of this rank's tokens
    pos = branch_mask.position_ids(cu_seqlens)  # O(T_global) integers, no activations
    return pos if ring.size == 1 else zigzag_shard(pos, cu_seqlens, ring.size, ring.rank)


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(target)
    cu = torch.tensor([0, 9, 16, 30], dtype=torch.int32)
    tokens = torch.randint(target.cfg.vocab_size, (30,))
    with torch.no_grad():
        out = target(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=3)
    loss.backward()
    print(f"draft taps {draft.tap_layers}, {sum(p.numel() for p in draft.parameters()):,} parameters")
    print(f"TTT loss {loss.item():.4f}; per pass acc {[round(a, 3) for a in m['acc']]}, "
          f"alpha {[round(a, 3) for a in m['alpha']]}, tau_hat {m['tau_hat']:.2f}")
    top = float(out.logits.softmax(-1).max(-1).values.mean())  # the policy's mean top-token probability
    print(f"  acc and tau_hat measure different things: acc is top-1 agreement (what greedy decoding, tau = 0, "
          f"accepts),\n  alpha = sum min(p, q) and tau_hat the acceptance when sampling at tau = 1; this random policy "
          f"is nearly flat\n  (mean top-token p {top:.3f}, uniform {1 / target.cfg.vocab_size:.3f}), so the untrained "
          f"draft's flat q overlaps it while its top-1 matches by chance")
    cache = draft.new_cache(1, 32)
    with torch.no_grad():
        h, z = draft.extend(cache, tokens[None, 1:9], {l: t[None, :8] for l, t in out.taps.items()},
                            torch.tensor([7]))
        props = [int(z.argmax(-1))]
        for _ in range(3):
            h, z = draft.step(cache, torch.tensor(props[-1:]), h)
            props.append(int(z.argmax(-1)))
    print(f"greedy proposals after the first 9 tokens of sequence 0: {props}")
