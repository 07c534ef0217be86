"""The DFlash draft [arXiv 2602.06036]: a whole block drafted in ONE forward, attending to the policy's own features.

    c_j   = hidden_norm(fc([f_1; ...; f_K]_j))               context: K taps of the policy at position j (K*H -> H)
    block = [y, MASK x (W - 1)] at positions s..s+W-1        y the last verified token, s its position
    per draft layer l (Qwen3 layers, q/k RMS-normed, RoPE):
        keys/values = [k_l(c_j), v_l(c_j) for j < s]  ;  [k_l(x_w), v_l(x_w) for the W block slots]   ("KV injection")
        queries     = the block slots only; non-causal inside the block
    q_w   = softmax(W_head norm(h_w))                        slot w predicts x_{s+w}; W_head is the POLICY's LM head

The embedding and the LM head are the policy's, shared and held detached (no gradient reaches the policy; the draft
has no head of its own). Inference (drafter.py): the draft's KV cache holds only the projected context (`extend`
appends the context entries of verified positions); `propose` runs the block once, samples slots 1..k, and drops
the block's own K/V. Training (draft_block.py): a block per sampled anchor a, [x_a, MASK x (W - 1)], every slot sees
the context j < a of its sequence and its whole block -- attention_cp.anchor_branch_attention with anchor_visible
False, the trunk K/V riding the zigzag ring under CP, the block local. Slot k predicts x_{a+k} against the policy's
distribution at a+k-1, weighted exp(-(k-1)/gamma), one mean over every trained (anchor, slot) pair (draft_block.py).

Taps (`default_dflash_taps`, z-lab's rule): one per draft layer, from layer 1 to layer n-3, evenly spread (Qwen3-8B
with the paper's 5 draft layers: 1, 9, 17, 25, 33 of 36); a one-layer draft reads the middle layer n // 2.

    python draft_dflash.py     # a DFlash draft learning (~15 s): tau_hat before and after, then one proposed block

Letters: T packed tokens, S sequences, N anchors, W block size, B batch rows, H hidden, K taps, V vocab.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import draft_block
from attention_cp import anchor_branch_attention
from branch_mask import position_ids as packed_positions, zigzag_shard
from decoding.spec_rule import sample
from draft import draft_device
from model import EMBED_TAP, ModelConfig, Transformer, check_tap_layers
from modeling.kv_cache import KVCache
from modeling.layers import DecoderLayer, RMSNorm, apply_rope, rope_cos_sin
from parallel.ring import as_ring
from serving.draft_checkpoint import read_draft, write_draft


def default_dflash_taps(n_layers: int, num_draft_layers: int) -> tuple:
    """z-lab's build_target_layer_ids: one tap per draft layer. One layer: n // 2; L layers: spread from layer 1 to
    layer n-3, round(1 + j (n - 4) / (L - 1)), j = 0..L-1, Python's round (half to even) as z-lab's (n = 36, L = 5:
    1, 9, 17, 25, 33; n = 36, L = 1: 18). Small n, where that repeats or leaves [0, n-1] (z-lab's would repeat ids,
    which check_tap_layers refuses): clamp into [0, n-1], push each collision up one layer (never past n-1), then
    drop what still collides (n = 6, L = 5 -> 1..5; n = 4, L = 3 -> 1, 2, 3; n = 1 -> 0)."""
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers}: expected >= 1")
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers={num_draft_layers}: expected >= 1")
    if num_draft_layers == 1:
        ideal = [n_layers // 2]
    else:
        span = n_layers - 4
        ideal = [int(round(1 + (j * span) / (num_draft_layers - 1))) for j in range(num_draft_layers)]
    taps = []
    for i in sorted(min(max(i, 0), n_layers - 1) for i in ideal):
        taps.append(min(max(i, taps[-1] + 1) if taps else i, n_layers - 1))
    return tuple(sorted(set(taps)))


@dataclass
class DFlashConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tap_layers: tuple  # policy layers whose outputs form the context (vLLM's dflash_config.target_layer_ids)
    target_num_layers: int
    mask_token_id: int  # the id of the block's MASK slots: one the policy never emits
    block_size: int = 8  # W: slots per block, k <= W - 1 drafts per step
    num_layers: int = 1  # draft decoder layers (the paper: 5 at 8B)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        self.tap_layers = check_tap_layers(self.tap_layers, self.target_num_layers)
        if not self.tap_layers or EMBED_TAP in self.tap_layers:
            raise ValueError(f"tap_layers={self.tap_layers}: expected >= 1 policy layer id, not the embeddings")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: expected >= 2 (the anchor slot and one draft slot)")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: expected >= 1")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id}: expected an id in [0, {self.vocab_size})")

    def layer_config(self) -> ModelConfig:  # the draft's decoder layers, Qwen3's (q/k RMSNorm)
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           qk_norm=True)


class DFlashDraft(nn.Module):
    """Parameter names follow the DFlash checkpoints vLLM loads (fc, hidden_norm, layers.{i}.*, norm)."""

    block_offset = 0  # slot w predicts x_{s+w+block_offset} (DSpark: 1)

    def __init__(self, cfg: DFlashConfig, policy):
        super().__init__()
        self.cfg, H = cfg, cfg.hidden_size
        self.lcfg = cfg.layer_config()
        self.fc = nn.Linear(len(cfg.tap_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(self.lcfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.apply(Transformer._init)
        self.attach(policy)

    # -- the drafter protocol's shape (drafter.py) -----------------------------------------------------------------
    @property
    def tap_layers(self) -> tuple:
        return self.cfg.tap_layers

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def max_draft_tokens(self) -> int:  # drafter.py: the trained slots, proposed from one block
        return len(self.trained_slots)

    def fresh(self, policy):  # drafter.py: untrained, the same config
        return type(self).from_target(policy, **{k: v for k, v in asdict(self.cfg).items() if k in self.build_keys})

    build_keys = ("mask_token_id", "tap_layers", "block_size", "num_layers", "intermediate_size")

    @property
    def trained_slots(self) -> tuple:  # block slots whose prediction is trained and proposed
        return tuple(range(1 - self.block_offset, self.cfg.block_size))

    @property
    def teacher_offsets(self) -> tuple:  # per trained slot k: the teacher's position a + k + block_offset - 1
        return tuple(k + self.block_offset - 1 for k in self.trained_slots)

    def attach(self, policy):
        """Share the policy's embedding and LM head (a Transformer with both), held detached: frozen for the draft,
        yet in-place updates of the policy show through. Call again after re-assembling the policy."""
        if not isinstance(policy, Transformer) or not hasattr(policy.model, "embed_tokens") or not policy.is_last:
            raise ValueError("policy: expected the whole policy (a Transformer with its embedding and LM head)")
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(policy.embed.weight.shape) != shape or tuple(policy.head_weight.shape) != shape:
            raise ValueError(f"policy: expected embedding and LM head of shape {shape}")
        self.register_buffer("embed_weight", policy.embed.weight.detach(), persistent=False)
        self.register_buffer("head_weight", policy.head_weight.detach(), persistent=False)

    @classmethod
    def from_target(cls, target: Transformer, *, mask_token_id: int, tap_layers=None, block_size: int = 8,
                    num_layers: int = 1, intermediate_size=None, **extra) -> "DFlashDraft":
        """A draft matched to `target`: its head shapes, taps (default default_dflash_taps(n, num_layers)), the final
        norm copied from the policy's, the embedding and LM head shared. extra: a variant's own config fields
        (DSpark's)."""
        c = target.cfg
        taps = default_dflash_taps(c.num_hidden_layers, int(num_layers)) if tap_layers is None else tuple(tap_layers)
        cfg = cls.config_class()(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                           intermediate_size=intermediate_size or c.intermediate_size,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                           head_dim=c.head_dim, tap_layers=taps, target_num_layers=c.num_hidden_layers,
                           mask_token_id=int(mask_token_id), block_size=int(block_size), num_layers=int(num_layers),
                           rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                           max_position_embeddings=c.max_position_embeddings, **extra)
        p = next(target.parameters())
        draft = cls(cfg, target).to(device=p.device, dtype=p.dtype)
        draft.attach(target)  # .to() may have copied the shared buffers
        with torch.no_grad():
            draft.norm.weight.copy_(target.model.norm.weight)
        return draft

    # -- the shared pieces -----------------------------------------------------------------------------------------
    def embed(self, tokens):  # (...) -> (..., H), no gradient into the shared embedding
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def context(self, taps: dict):  # {layer: (..., H)} -> c (..., H) = hidden_norm(fc(concat))
        missing = [l for l in self.tap_layers if l not in taps]
        if missing:
            raise ValueError(f"taps: missing layers {missing}; the draft reads {self.tap_layers}")
        return self.hidden_norm(self.fc(torch.cat([taps[l].to(self.fc.weight.dtype) for l in self.tap_layers], -1)))

    def context_kv(self, layer, c, cos, sin):  # KV injection: c (..., H) -> k (RMS-normed, RoPE), v (..., Hkv, D)
        a, L = layer.self_attn, self.lcfg
        k = a.k_norm(a.k_proj(c).unflatten(-1, (L.num_key_value_heads, L.head_dim)))
        return apply_rope(k, cos, sin), a.v_proj(c).unflatten(-1, (L.num_key_value_heads, L.head_dim))

    def logits(self, h):  # (..., H) -> (..., V) through the policy's LM head
        return F.linear(self.norm(h), self.head_weight.to(h.dtype))

    def block_tokens(self, first):  # (n,) -> (n, W): [first, MASK x (W - 1)]
        blk = first.new_full((first.shape[0], self.cfg.block_size), self.cfg.mask_token_id)
        blk[:, 0] = first
        return blk

    # -- inference: the draft's own KV cache holds the projected context ------------------------------------------
    def new_cache(self, batch: int, max_len: int, block: int = None) -> KVCache:
        """The context K/V of every draft layer; max_len leaves room for the block (+ W - 1 past the last entry)."""
        return KVCache(self.lcfg, batch, max_len + self.cfg.block_size, dtype=self.fc.weight.dtype,
                       device=self.fc.weight.device, block=block)

    def extend(self, cache: KVCache, tokens, taps: dict, last):
        """Append the context entries of verified positions: entry j of row b is the taps at j (tokens[b, j], the
        token after j, is not an input: the block carries it). Row b keeps entries 0..last[b]. Returns the state
        (y,): y (B,) = tokens[b, last[b]], the first slot of the next block."""
        L0 = cache.lengths.clone()
        c = self.context(taps)  # (B, N, H)
        pos = cache.begin(c.shape[1])  # (B, N)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, c.dtype, bound=cache.key_len)
        for i, layer in enumerate(self.layers):
            cache.write(i, *self.context_kv(layer, c, cos, sin))  # keys only: no query reads the context here
        cache.commit()
        cache.rollback(L0 + last + 1)
        return (tokens[torch.arange(tokens.shape[0], device=tokens.device), last],)

    def run_block(self, cache: KVCache, first):
        """One forward over [first, MASK x (W - 1)] at positions lengths..lengths+W-1, non-causal in the block, over
        the cached context; the block's K/V dropped afterwards -> h (B, W, H) final states (pre-norm)."""
        L0, bound = cache.lengths.clone(), cache.bound
        x = self.embed(self.block_tokens(first))  # (B, W, H)
        pos = cache.begin(x.shape[1], causal=False)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, bound=cache.key_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, lambda y, a=layer.self_attn, i=i: a.forward_cached(y, cos, sin, cache, i))
        cache.commit()
        cache.rollback(L0, bound=bound)
        return x

    def propose(self, cache: KVCache, state, k: int, temperature: float, generator=None):
        """drafter.py: one block forward, slots 1..k sampled independently from their own q -> d (B, k), q (B, k, V)
        (None at tau = 0). The cache is unchanged."""
        h = self.run_block(cache, state[0])
        z = self.logits(h[:, list(self.trained_slots[:k])])  # (B, k, V)
        ds, qs = zip(*(sample(z[:, j], temperature, generator) for j in range(k)))
        return torch.stack(ds, 1), (torch.stack(qs, 1) if temperature > 0 else None)

    # -- training (draft_block.py) ---------------------------------------------------------------------------------
    def block_forward(self, taps, tokens, cu_seqlens, anchors, *, position_ids=None, group=None, attn_fn=None,
                      backend: str = "torch"):
        """The blocks of `anchors` (N,) local rows over the packed context -> h (N, W, H) (pre-norm). taps {layer:
        (T, H)} (detached by the caller), tokens (T,), cu_seqlens the global (CP-padded under CP) boundaries."""
        ring = as_ring(group)
        attn_fn = anchor_branch_attention if attn_fn is None else attn_fn  # tests pass the dense oracle
        pos = position_ids
        if pos is None:
            pos = packed_positions(cu_seqlens)
            pos = pos if ring.size == 1 else zigzag_shard(pos, cu_seqlens, ring.size, ring.rank)
        pos = pos.long()
        W = self.cfg.block_size
        c = self.context(taps)  # (T, H)
        cos_t, sin_t = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, c.dtype)
        bpos = pos[anchors][:, None] + torch.arange(W, device=pos.device)  # (N, W)
        cos_b, sin_b = rope_cos_sin(bpos, self.cfg.head_dim, self.cfg.rope_theta, c.dtype)
        x = self.block_inputs(taps, tokens, anchors)  # (N, W, H)
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        for layer in self.layers:
            kc, vc = self.context_kv(layer, c, cos_t, sin_t)  # (T, Hkv, D) the trunk: rides the ring under CP

            def attend(y, a=layer.self_attn, kc=kc, vc=vc):
                q, bk, bv = a.qkv(y, cos_b, sin_b)  # (N, W, Hq|Hkv, D): the block, local to its anchor's rank
                o = attn_fn(q, kc, vc, cu_seqlens, anchors, bk, bv, anchor_visible=False, group=ring,
                            softmax_scale=scale, backend=backend)
                return a.o_proj(o.flatten(-2))
            x = layer(x, attend)
        return x

    def block_inputs(self, taps, tokens, anchors):
        """(N, W, H) [e(x_a), e(MASK) x (W - 1)]. e(x_a) is the policy's embedding tap at the anchor when the taps
        carry it (EMBED_TAP: stage 0's, through TapChannel under PP, as TTT reads e(x_{i+d})); the shared embedding
        is read for the MASK row alone."""
        N, W = anchors.shape[0], self.cfg.block_size
        first = taps[EMBED_TAP][anchors].to(self.fc.weight.dtype) if EMBED_TAP in taps else self.embed(tokens[anchors])
        mask = self.embed(tokens.new_full((1, 1), self.cfg.mask_token_id)).expand(N, W - 1, -1)
        return torch.cat([first[:, None], mask], 1)

    def loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, **kw):
        """drafter.py: the block loss on the policy's own forward -> (loss, metrics): draft_block.train_blocks."""
        return draft_block.train_blocks(self, taps, tokens, cu_seqlens, teacher_logits, **kw)

    def block_loss(self, h, teacher, valid, src, count, *, gamma: float, chunk: int, slot_tokens=None):
        """draft_block.block_loss (slot_tokens(k) -> (N,) the token at each anchor's slot k: DSpark's input)."""
        return draft_block.block_loss(self, h, teacher, valid, src, count, gamma=gamma, chunk=chunk)

    @staticmethod
    def loss_options(trainer) -> dict:  # drafter.py: anchors per sequence, gamma, seed (rl_loop.DraftTrainer.opts)
        return {k: v for k, v in trainer.opts.items() if k in ("anchors", "gamma", "seed")}

    # -- checkpoints -----------------------------------------------------------------------------------------------
    architecture = "CospecDFlashDraft"

    def save(self, path: str):
        """config.json + model.safetensors (not the shared embedding and head), each written atomically."""
        write_draft(path, dict(self.config_dict(), architectures=[self.architecture]), self.state_dict())

    def config_dict(self) -> dict:
        return dict(asdict(self.cfg), tap_layers=list(self.cfg.tap_layers))

    @classmethod
    def config_class(cls):
        return DFlashConfig

    @classmethod
    def load(cls, path: str, policy) -> "DFlashDraft":
        """A draft saved by `save`, sharing `policy`'s embedding and LM head."""
        raw, sd = read_draft(path, cls.architecture)
        draft = cls(cls.config_class()(**raw), policy).to(device=draft_device(policy), dtype=sd["fc.weight"].dtype)
        draft.load_state_dict(sd)
        draft.attach(policy)
        return draft

    def export(self, path: str, *, dtype=torch.bfloat16, **kw):
        """vLLM's DFlash serving format (serving/export_dflash.py); kw: max_position_embeddings, pair."""
        from serving.export_dflash import export_dflash
        export_dflash(self, path, dtype=dtype, **kw)

    def check_exportable(self):  # drafter.py: vLLM's DFlash loader reads every field this draft has
        return None

    # -- the family's facts (drafter.FAMILY): what the config, the memory plan and --draft ask of the class ---------
    kind = "block"  # a fixed k of at most its trained slots, from one forward (drafter.py)
    taps_rule = "ascending ids in [0, the policy's layers - 1]"  # vLLM's DFlash format reads any number
    fit_rule = "k + 1"  # the block --block_size=0 fits to k drafts: slot 0 is the anchor
    slots_rule = "block_size - 1"  # the most drafts per forward of a block of block_size slots

    @staticmethod
    def fitted_block(k: int) -> int:  # W for k drafts (fit_rule)
        return k + 1

    @staticmethod
    def slots_drafted(W: int) -> int:  # the drafts a block of W slots trains and proposes (slots_rule)
        return W - 1

    @staticmethod
    def default_taps(n_layers: int, cfg) -> tuple:  # --tap_layers='': one per draft layer (--draft_layers)
        return default_dflash_taps(n_layers, cfg.draft_layers)

    @staticmethod
    def taps_ok(taps: tuple, n_layers: int) -> bool:  # ascending distinct ints (taps_rule)
        return 0 <= taps[0] <= taps[-1] < n_layers

    @classmethod
    def shape_options(cls, cfg) -> dict:  # from_target's options that size it (the MASK id changes no size)
        return dict(mask_token_id=0, block_size=max(cfg.block_slots, 2), num_layers=cfg.draft_layers)

    @classmethod
    def of_shape(cls, m: ModelConfig, cfg, taps: tuple):  # the run's draft, to count (built on meta)
        return cls.from_target(Transformer(m), tap_layers=taps, **cls.shape_options(cfg))

    @staticmethod
    def cache_shape(cfg) -> tuple:  # the rollout's draft KV cache: (layers, slots beyond the policy's: its block)
        return cfg.draft_layers, cfg.block_slots

    @staticmethod
    def act_bytes(size, cfg, T: float, n_taps: int, seqs: float) -> float:
        """Saved for backward over T tokens: fc's concatenated taps, the context and its norms, each draft layer's
        injected K / V; + the `seqs` x --anchors W-slot blocks through the layers (q / k RMS-normed), the final
        norm and the streamed loss's normalisers per slot. size: harness/memory_model.Sizes."""
        KV, L_d = size.m.num_key_value_heads * size.m.head_dim, cfg.draft_layers
        slots = seqs * cfg.anchors * max(cfg.block_slots, 2)
        return (T * (n_taps * size.H * size.b + 2 * size.norm + L_d * 4 * KV * size.b)
                + slots * (L_d * size.layer(qk_norm=True) + size.norm + 12))

    @staticmethod
    def size_flags(cfg) -> str:  # the flags that size its copy
        return f"--draft_layers={cfg.draft_layers}"

    @staticmethod
    def check_file(path: str, fmt: str):  # --draft: the format's own checks are all it needs
        return None

    @classmethod
    def from_fields(cls, fields: dict, sd: dict, path: str, n_layers: int) -> tuple:  # --draft: (config, tensors)
        return cls.config_class()(**fields), sd


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
    from drafter import demo
    demo("DFlash (blocks of 4)", lambda p: DFlashDraft.from_target(p, mask_token_id=0, block_size=4), k=3,
         anchors=4)
