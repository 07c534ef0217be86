"""The policy: a Llama / Qwen2 / Qwen3-family decoder, readable in one sitting.

    h_0 = E[x];   h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}));   h_l += MLP(RMSNorm(h_l));   logits = W_out RMSNorm(h_n)

Three ways in:
  * packed varlen training forward: tokens [T] + cu_seqlens [S+1] + per-token positions; attention is a pluggable
    function (the default is exact per-sequence causal SDPA; attention_cp.ring_branch_attention drops in for CP);
  * cached generation: tokens [B, S] appended to a KVCache whose rows have their own lengths (speculative decoding
    appends k+1 tokens per row and rolls rows back by different amounts);
  * pipeline-stage slices: Transformer(cfg, layers=(a, b)) holds only layers [a, b); the embedding lives on the stage
    with a == 0 and the final norm + LM head on the stage with b == n.
Every forward can return feature taps: the hidden state after chosen layers (tap -1 = the input embeddings), which is
what the EAGLE-3 draft reads.  Parameter names are HF's, so checkpoints map one to one (from_pretrained, hf_io.py).

    python model.py            # builds the `tiny` preset, runs a packed forward and a cached greedy decode

Letters: T packed tokens, S sequences, B batch rows, L cache length, H hidden, Hq/Hkv heads, D head dim, V vocab.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint

import branch_mask
from modeling.kv_cache import KVCache
from modeling.layers import DecoderLayer, RMSNorm, linear_f32, packed_causal_attention, rope_cos_sin

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
EMBED_TAP = -1  # tap id of the input embeddings (the "hidden state after layer -1")


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    o_bias: bool = False  # Llama attention_bias=True also biases o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        """Every field checked once, here, for every consumer (the model, HF configs, the memory plan, the cost model):
        all problems in one line, each naming the field and what was expected."""
        bad = config_problems(self)
        if bad:
            raise ValueError("; ".join(bad))
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"preset={name!r}: expected one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


_AT_LEAST_1 = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")


def config_problems(c: ModelConfig) -> list:
    """What is wrong with a ModelConfig, one entry per field: `num_attention_heads=0: expected an integer >= 1`."""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    bad = [f"{k}={getattr(c, k)!r}: expected an integer >= 1" for k in _AT_LEAST_1
           if not (is_int(getattr(c, k)) and getattr(c, k) >= 1)]
    bad += [f"{k}={getattr(c, k)!r}: expected a number > 0" for k in ("rms_norm_eps", "rope_theta")
            if not (is_num(getattr(c, k)) and getattr(c, k) > 0)]
    if c.architecture not in ARCHITECTURES:
        bad.append(f"architecture={c.architecture!r}: expected one of {ARCHITECTURES}")
    if bad:  # the checks across fields need these to be numbers
        return bad
    n, kv, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    if n % kv:
        bad.append(f"num_key_value_heads={kv}: expected a divisor of num_attention_heads={n} (GQA)")
    if h is None and c.hidden_size % n:
        bad.append(f"hidden_size={c.hidden_size}: expected a multiple of num_attention_heads={n} (head_dim = "
                   "hidden_size / heads), or an explicit head_dim")
    head_dim = c.hidden_size // n if h is None else h
    if not (is_int(head_dim) and head_dim >= 2 and head_dim % 2 == 0):
        bad.append(f"head_dim={head_dim!r}: expected an even integer >= 2 (RoPE rotates pairs)")
    return bad


PRESETS = {
    # tests: a few hundred KB, every feature on the fast path
    "tiny": ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2),
    # the CPU demo policies: mini (~0.35M parameters) for the default experiment, small (~1.1M) for longer runs
    "mini": ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "small": ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=352, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # the smallest policy vLLM's CPU attention serves (head sizes 32, 64, 80, ...; tiny's 8 and mini's 16 are not):
    # ~0.13M parameters, head_dim 32, 4 layers (3 taps below the last); tests/test_vllm_engine.py serves it
    "serve": ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
}


def default_tap_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high taps (1, n//2 - 1, n - 4), 0-indexed; vLLM and SGLang default to the same layers
    (their ids are one higher: they capture the state *entering* a layer).

    Rule for small n. n >= 4: three distinct taps in [0, n-2] -- the engines' `fc` reads exactly 3 states and none may
    be the last layer's output (export.py) -- got by sorting the clamped ids and pushing each collision up one layer:
    n = 4 -> (0, 1, 2), n = 5 -> (1, 2, 3), n = 6 -> (1, 2, 3), n = 7 -> (1, 2, 3), n >= 8 unchanged (1, n//2-1, n-4).
    n < 4 (trainable, not exportable): clamp into [0, n-1] and drop duplicates: n = 1 -> (0,), 2 -> (0, 1), 3 -> (0, 1).
    """
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers}: expected >= 1")
    ideal = (1, n_layers // 2 - 1, n_layers - 4)
    if n_layers < 4:
        return tuple(sorted({min(max(i, 0), n_layers - 1) for i in ideal}))
    taps = []
    for i in sorted(min(max(i, 0), n_layers - 2) for i in ideal):
        taps.append(max(i, taps[-1] + 1) if taps else i)  # never past n-2: the ideal ids are <= n-4 and n//2-1
    return tuple(taps)


def check_tap_layers(tap_layers, n_layers: int) -> tuple[int, ...]:
    """Explicit tap ids as ints: each an integer (1.7 or True is an error, never truncated) in -1 .. n_layers - 1."""
    taps = []
    for t in tap_layers:
        try:
            if isinstance(t, bool):
                raise TypeError
            taps.append(operator.index(t))  # int, numpy or 0-dim torch integers; floats refuse
        except TypeError:
            raise ValueError(f"tap_layers={tuple(tap_layers)}: id {t!r} is not an integer layer id") from None
    taps = tuple(taps)
    bad = [t for t in taps if not (EMBED_TAP <= t < n_layers)]
    if bad:
        raise ValueError(f"tap_layers={taps}: ids {bad} out of range; expected -1 (embeddings) .. {n_layers - 1}")
    if len(set(taps)) != len(taps):
        raise ValueError(f"tap_layers={taps}: duplicate ids")
    return taps


# --------------------------------------------------------------------------------------------------------- the model
@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]  # (..., V) on the last stage, else None
    hidden: torch.Tensor  # (..., H) final-normed hidden on the last stage, else the stage's output hidden
    taps: dict  # {layer id: (..., H)} hidden after that layer (-1: embeddings), only those this stage produced


class Transformer(nn.Module):
    """A decoder, or the pipeline-stage slice of one holding layers [a, b)."""

    def __init__(self, cfg: ModelConfig, layers: Optional[tuple[int, int]] = None, *,
                 activation_checkpointing: bool = False):
        super().__init__()
        # per decoder layer: keep only its input, recompute the layer in backward (memory O(L T H) -> O(T H) per layer
        # kept, one extra forward of compute; under CP the recompute runs the ring again, on every rank alike)
        self.activation_checkpointing = bool(activation_checkpointing)
        n = cfg.num_hidden_layers
        a, b = (0, n) if layers is None else (int(layers[0]), int(layers[1]))
        if not (0 <= a < b <= n):
            raise ValueError(f"layers=({a}, {b}): expected 0 <= a < b <= num_hidden_layers={n}")
        self.cfg, self.layer_range = cfg, (a, b)
        self.is_first, self.is_last = a == 0, b == n
        self.model = nn.Module()  # HF nesting: model.embed_tokens, model.layers.{i}, model.norm; lm_head
        if self.is_first or (self.is_last and cfg.tie_word_embeddings):
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(a, b)})
        if self.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if not cfg.tie_word_embeddings:
                self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def embed(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def head_weight(self) -> torch.Tensor:  # (V, H) the LM head (the embedding when tied)
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def head(self, h):  # final-normed hidden (..., H) -> logits (..., V), fp32 at least (the matmul too: linear_f32)
        return linear_f32(h, self.head_weight)

    # -- input checks: loud and naming the argument ---------------------------------------------------------------
    def _check_input(self, x, batch_dims: int, host: bool = True):
        """host=False: the token range is checked by a device-side assert (no host sync; on a GPU a bad id stops the
        stream with a device assert instead of raising here)."""
        want = batch_dims if self.is_first else batch_dims + 1
        if self.is_first and (x.dtype not in (torch.int32, torch.int64)):
            raise TypeError(f"tokens: expected an int32/int64 tensor on the first stage, got {x.dtype}")
        if not self.is_first and not x.is_floating_point():
            raise TypeError(f"hidden: expected a floating tensor on stage {self.layer_range}, got {x.dtype}")
        if x.dim() != want:
            raise ValueError(f"{'tokens' if self.is_first else 'hidden'}: expected {want} dims, got shape "
                             f"{tuple(x.shape)}")
        if not self.is_first and x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden: last dim {x.shape[-1]} != hidden_size={self.cfg.hidden_size}")
        if self.is_first and x.numel():
            lo, hi = torch.aminmax(x)  # one pass
            if not host:
                torch._assert_async((lo >= 0) & (hi < self.cfg.vocab_size),
                                    f"tokens: ids must lie in [0, vocab_size={self.cfg.vocab_size})")
            elif int(lo) < 0 or int(hi) >= self.cfg.vocab_size:  # one host sync
                raise ValueError(f"tokens: ids must lie in [0, vocab_size={self.cfg.vocab_size})")

    def _taps(self, tap_layers):
        return () if tap_layers is None else check_tap_layers(tap_layers, self.cfg.num_hidden_layers)

    def _run(self, x, attend_for, tap_layers, pos, checkpointing=False, logits=True, pos_bound=None):
        """Shared body: embed (first stage) -> layers -> norm + head (last stage), collecting taps. pos_bound: a host
        int > every position (rope_cos_sin then reads no maximum)."""
        taps_wanted = self._taps(tap_layers)
        h = self.embed(x) if self.is_first else x
        taps = {}
        if self.is_first and EMBED_TAP in taps_wanted:
            taps[EMBED_TAP] = h
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype, bound=pos_bound)
        ckpt = checkpointing and torch.is_grad_enabled()  # packed forward only: a recompute would re-fill a KV cache
        for key, layer in self.model.layers.items():
            attend = attend_for(layer, int(key), cos, sin)
            if ckpt:  # non-reentrant: gradients reach every input, the closure's tensors (cos, sin) included
                h = torch.utils.checkpoint.checkpoint(layer, h, attend, use_reentrant=False)
            else:
                h = layer(h, attend)
            if int(key) in taps_wanted:
                taps[int(key)] = h
        if not self.is_last:
            return ModelOutput(None, h, taps)
        h = self.model.norm(h)
        if isinstance(logits, torch.Tensor):  # (B,) one position per row: the head on those rows only -> (B, V)
            return ModelOutput(self.head(h[torch.arange(h.shape[0], device=h.device), logits]), h, taps)
        return ModelOutput(self.head(h) if logits else None, h, taps)  # logits=False: no (T, V) tensor (fused_logprob)

    def forward(self, x, cu_seqlens, position_ids=None, *, attn_fn: Optional[Callable] = None, tap_layers=None,
                logits: bool = True):
        """Packed varlen forward.

        x: tokens (T,) on the first stage, hidden (T, H) on later stages; cu_seqlens int32 (S+1); position_ids (T,)
        (default: 0.. within each sequence; given, each below the longest sequence's length, as a CP shard's are).
        attn_fn(q, k, v, cu_seqlens, *, softmax_scale) -> (T, Hq, D).
        logits=False: the last stage returns only the final normed hidden (out.hidden), for the fused log-probs and
        the draft's fused teacher (fused_logprob.py, draft_loss.py), which apply the head chunk by chunk.
        """
        self._check_input(x, 1, host=x.device.type == "cpu")  # on a GPU a device-side assert: no host sync
        T = x.shape[0]
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens: expected an int32 tensor [S+1]")
        cu = branch_mask.host_cu(cu_seqlens) if cu_seqlens.dim() == 1 else ()  # checked on the host copy
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor [S+1] starting at 0, got {cu_seqlens.tolist()}")
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: must be strictly increasing, got {list(cu)}")
        if position_ids is None:
            if cu[-1] != T:
                raise ValueError(f"cu_seqlens[-1]={cu[-1]} does not match the token count T={T}")
            position_ids = branch_mask.position_ids(cu_seqlens)
        elif position_ids.shape != (T,):
            raise ValueError(f"position_ids: expected shape ({T},), got {tuple(position_ids.shape)}")
        attn_fn = attn_fn or packed_causal_attention

        def attend_for(layer, _, cos, sin):
            return lambda hn: layer.self_attn(hn, cos, sin, cu_seqlens, attn_fn)

        bound = max(b - a for a, b in zip(cu, cu[1:]))  # > every position (0.. within its sequence): no host sync
        return self._run(x, attend_for, tap_layers, position_ids, self.activation_checkpointing, logits, bound)

    def forward_cached(self, x, cache: KVCache, *, tap_layers=None, tree=None, logits_at=None):
        """Append x (B, S) tokens (or (B, S, H) hidden on later stages) to every row of `cache` and return their
        outputs. Each row's new tokens sit at positions cache.lengths[b] + 0..S-1; lengths advance by S.
        tree: the S tokens are tree nodes instead, a kv_cache.TreeNodes or (depth, visible, base) (KVCache.begin:
        positions base + depth, each node sees the prefix and its ancestors).
        logits_at (B,) long: the logits only at new token logits_at[b] of row b -> out.logits (B, V), not (B, S, V)
        (a prefill samples from one position per row)."""
        self._check_input(x, 2, host=False)  # decoding: no host sync per forward
        if x.shape[0] != cache.batch:
            raise ValueError(f"x: batch {x.shape[0]} != cache batch {cache.batch}")
        if logits_at is not None and (not isinstance(logits_at, torch.Tensor) or logits_at.shape != (x.shape[0],)):
            raise ValueError(f"logits_at: expected a ({x.shape[0]},) tensor of positions, got "
                             f"{getattr(logits_at, 'shape', logits_at)}")
        pos = cache.begin(x.shape[1], tree)  # (B, S)

        def attend_for(layer, key, cos, sin):
            return lambda hn: layer.self_attn.forward_cached(hn, cos, sin, cache, key)

        out = self._run(x, attend_for, tap_layers, pos, logits=True if logits_at is None else logits_at.long(),
                        pos_bound=cache.key_len)
        cache.commit()
        return out

    def new_cache(self, batch: int, max_len: int, dtype=None, block: int = None) -> KVCache:
        """A KV cache for up to max_len entries per row, allocated in blocks of `block` positions as rows grow."""
        dtype = dtype or next(self.parameters()).dtype
        return KVCache(self.cfg, batch, max_len, layers=[int(k) for k in self.model.layers],
                       dtype=dtype, device=next(self.parameters()).device, block=block)

    def load_slice(self, full_state_dict: dict, strict: bool = True):
        """Load just this stage's part of a full model's state dict."""
        own = self.state_dict()
        missing = [k for k in own if k not in full_state_dict]
        if strict and missing:
            raise ValueError(f"state dict lacks {len(missing)} keys this stage needs, e.g. {missing[:3]}")
        self.load_state_dict({k: full_state_dict[k] for k in own if k in full_state_dict}, strict=strict)


@torch.no_grad()
def greedy_generate(model: Transformer, prompts: list, max_new_tokens: int) -> list:
    """Plain batched greedy decoding with the per-row KV cache: the reference every faster decoder must match."""
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty 1-D token tensors")
    dev = next(model.parameters()).device  # inputs, cache and outputs live with the model
    B, n = len(prompts), [p.numel() for p in prompts]
    lens = torch.tensor(n, device=dev)
    cache = model.new_cache(B, max(n) + max_new_tokens)
    x = torch.zeros(B, max(n), dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        x[b, : p.numel()] = p
    logits = model.forward_cached(x, cache, logits_at=lens - 1).logits  # (B, V) at each row's last prompt token
    cache.rollback(lens)  # right-padded prefill: roll back the padding
    nxt = logits.argmax(-1)
    out = [nxt]
    for _ in range(max_new_tokens - 1):
        nxt = model.forward_cached(nxt[:, None], cache).logits[:, -1].argmax(-1)
        out.append(nxt)
    return list(torch.stack(out, 1)) if max_new_tokens > 0 else [torch.zeros(0, dtype=torch.long, device=dev)] * B


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    m = Transformer(cfg)
    lens = [5, 3, 7]
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    toks = torch.randint(cfg.vocab_size, (15,))
    out = m(toks, cu, tap_layers=default_tap_layers(cfg.num_hidden_layers) + (EMBED_TAP,))
    print(f"packed forward: logits {tuple(out.logits.shape)}, taps {sorted(out.taps)}")
    print("greedy:", [g.tolist() for g in greedy_generate(m, [toks[:5], toks[5:8]], 6)])
