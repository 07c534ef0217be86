"""The policy's building blocks, as HF's Llama / Qwen layers compute them: RMSNorm, RoPE, attention (packed or
cached), the SwiGLU MLP and the pre-norm decoder layer. model.py assembles them into the Transformer; draft.py reuses
them for the EAGLE-3 draft's one layer. Parameter names are HF's, so checkpoints map one to one.

    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
    RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) at angle p theta^(-2i/D)
    h = h + Attn(RMSNorm(h));  h = h + MLP(RMSNorm(h)),  MLP(x) = W_down (silu(W_gate x) * W_up x)

Each module takes cfg, a model.ModelConfig (its fields only: no import of model.py, which sits above this file).

Letters: T packed tokens, B batch rows, S new tokens per row, H hidden, Hq / Hkv heads, D head dim.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import branch_mask
from modeling.kv_cache import KVCache

def at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 at least, for softmax and log-sum-exp statistics of bf16 / fp16 logits (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


HALF = (torch.bfloat16, torch.float16)
CAST_BLOCK_MIB = 32.0  # mm_f32 / addmm_f32_ without out_dtype: 16-bit operands cast to fp32 this many MiB at a time


def _works(op) -> bool:
    try:
        return bool(op())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def out_dtype_ops() -> tuple:
    """(mm, addmm): does this torch's CUDA mm take out_dtype (16-bit in, fp32 out; torch >= 2.8), and its addmm an
    fp32 accumulator that is also `out` (builds differ)? Probed once on 16 x 16 ones (one host read)."""
    a, c = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16), torch.ones(16, 16, device="cuda")
    return (_works(lambda: torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32),
            _works(lambda: float(torch.addmm(c, a, a, out_dtype=torch.float32, out=c)[0, 0]) == 17.0))


@contextlib.contextmanager
def _tf32_exact(t: torch.Tensor):
    """CUDA: fp32 matmuls may use TF32 while the block products run (process-wide while it lasts). Exact for operands
    that hold bf16 / fp16 values: TF32's 11 significant bits hold bf16's 8 and fp16's 11, and it accumulates in fp32.
    The CPU, or a torch that refuses the flag (>= 2.9 after its fp32_precision API was used): plain fp32 math."""
    m, before = torch.backends.cuda.matmul, None
    try:
        if t.is_cuda:
            before, m.allow_tf32 = m.allow_tf32, True
    except RuntimeError:
        before = None
    try:
        yield
    finally:
        if before is not None:
            m.allow_tf32 = before


def _blocks(n: int, width: int):
    """[lo, hi) ranges over n rows of `width` elements, each at most CAST_BLOCK_MIB MiB in fp32."""
    step = max(1, int(CAST_BLOCK_MIB * 2**20) // (4 * max(width, 1)))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(m, k) @ (k, n) -> (m, n) fp32 for 16-bit a, b of one dtype: fp32 accumulation and an fp32 result (a bf16
    matmul rounds its output to ~2^-9 relative). The product of two bf16 (or fp16) numbers is exact in fp32, so
    casting them loses nothing. CUDA with out_dtype: the 16-bit tensor cores, no cast. Otherwise fp32 math on the
    same values, b cast CAST_BLOCK_MIB of columns at a time (never a whole fp32 copy of a (V, H) weight)."""
    if a.is_cuda and out_dtype_ops()[0]:
        return torch.mm(a, b, out_dtype=torch.float32)
    out, af = a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32), a.float()  # af (m, k): the small operand
    with _tf32_exact(a):
        for lo, hi in _blocks(b.shape[1], b.shape[0]):
            out[:, lo:hi] = af @ b[:, lo:hi].float()  # (k, block) fp32: the only cast of b
    return out


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b in place: acc (m, n) fp32 (a weight's fp32 gradient), a (m, k), b (k, n) 16-bit of one dtype;
    fp32 accumulation as in mm_f32, and no (m, n) temporary. CUDA addmm with out_dtype where it takes acc as its
    out; otherwise a cast CAST_BLOCK_MIB of rows at a time, acc's rows updated in place."""
    if acc.is_cuda and out_dtype_ops()[1]:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    bf = b.float()  # (k, n): the small operand
    with _tf32_exact(acc):
        for lo, hi in _blocks(a.shape[0], a.shape[1]):
            acc[lo:hi].addmm_(a[lo:hi].float(), bf)  # (block, k) fp32: the only cast of a
    return acc


def linear_f32(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """(..., H) @ (V, H)^T -> (..., V) logits in fp32 at least: the LM head of every log-prob that GRPO compares
    (the rollout's, fused_logprob's). A bf16 matmul accumulates in fp32 but rounds its output to bf16: ~2^-9 relative,
    0.02-0.04 on a logit of 10, straight into log p. 16-bit x and W without autograd (decode, fused_logprob's
    chunks): mm_f32, fp32 accumulation of the 16-bit values and no fp32 copy of W. Under autograd (the dense
    reference, the unfused (T, V) path) both operands are cast to fp32, which autograd differentiates."""
    if x.dtype not in HALF:
        return at_least_f32(F.linear(x, W))
    if W.dtype != x.dtype or (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad)):
        return F.linear(x.float(), W.float())
    return mm_f32(x.reshape(-1, x.shape[-1]), W.t()).reshape(*x.shape[:-1], W.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim); statistics in fp32 as HF does
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_table(n: int, head_dim: int, theta: float, dtype: torch.dtype, device=None):
    """cos, sin (n, D) for positions 0..n-1: angles p * theta^(-2i/D) in fp64, halves repeated (HF's rotate_half)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq  # (n, D/2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


_ROPE_TABLES: dict = {}  # (D, theta, dtype, device) -> rope_table(n, ...), n a power of two, grown on demand


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, bound: int = None):
    """cos, sin [..., D] for integer positions [...] >= 0, read from a cached rope_table: two gathers per forward
    instead of ~10 ops (a decode step of the draft is ~40 ops in all). Same values as computing them directly.
    bound: a host int > every position (a KV cache's key_len): no host sync; None reads max(positions), one sync."""
    if bound is not None:
        need = max(int(bound), 1)
    else:
        need = int(positions.max()) + 1 if positions.numel() else 1  # host sync: the table may have to grow
    key = (head_dim, float(theta), dtype, positions.device)
    tab = _ROPE_TABLES.get(key)
    if tab is None or tab[0].shape[0] < need:
        with torch.inference_mode(False):  # a normal tensor: it is also read by forwards that autograd records
            tab = _ROPE_TABLES[key] = rope_table(max(1024, 1 << (need - 1).bit_length()), head_dim, theta, dtype,
                                                 positions.device)
    return tab[0][positions], tab[1][positions]


def apply_rope(x, cos, sin):  # x (..., Hx, D), cos/sin (..., D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(-2) + torch.cat([-x2, x1], dim=-1) * sin.unsqueeze(-2)


def packed_causal_attention(q, k, v, cu_seqlens, softmax_scale):
    """Default attn_fn: exact causal attention within each packed sequence (SDPA per sequence, no T x T mask).

    q (T, Hq, D), k/v (T, Hkv, D), cu_seqlens int32 (S+1) -> (T, Hq, D)."""
    T = q.shape[0]
    bounds = branch_mask.host_cu(cu_seqlens)  # the boundaries drive the Python loop: the host copy, no sync per layer
    if bounds[-1] != T:
        raise ValueError(f"cu_seqlens[-1]={bounds[-1]} does not match the token count T={T}")
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # (H, Ls, D)
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale).transpose(0, 1)
    return out


CACHED_SCORES_MIB = 256.0  # cached_attention's block of query rows: its (B, Hq, rows, Lk) fp32 scores at most this


def cached_attention(q, K, V, visible, softmax_scale: float, scores_mib: float = None):
    """Attention of S new entries per row against a KV cache, without a (B, S, Lk) mask or a GQA copy of K/V.

    q (B, S, Hq, D); K, V (B, Hkv, Lk, D) (the cache's views); visible(lo, hi) -> (B, hi - lo, Lk) bool (KVCache.
    visible) -> (B, S, Hq, D). GQA: query head h reads KV head h // G (G = Hq / Hkv), so the G query heads of a KV head
    are folded into its rows, q -> (B, Hkv, G * n, D) against K (B, Hkv, Lk, D): K and V are read as they lie (SDPA's
    enable_gqa with a mask has no fused kernel and falls back to expanding them). Prefill: the S rows go in blocks of
    n rows, n from a byte budget on the block's (B, Hq, n, Lk) fp32 scores (what SDPA's math kernel holds), so a
    prompt of P tokens never holds an O(P^2) tensor; decode (S = k + 1) is one block. Each query row's softmax is its
    own, so the blocks change no result. scores_mib None: CACHED_SCORES_MIB."""
    B, S, Hq, D = q.shape
    Lk = K.shape[2]
    scores_mib = CACHED_SCORES_MIB if scores_mib is None else scores_mib
    n = max(1, int(scores_mib * 2**20) // (4 * B * Hq * max(Lk, 1)))
    if n >= S:  # one block (decode): no copy of the output
        return _cached_block(q, K, V, visible(0, S), softmax_scale)
    out = q.new_empty(B, S, Hq, D)
    for lo in range(0, S, n):
        hi = min(S, lo + n)
        out[:, lo:hi] = _cached_block(q[:, lo:hi], K, V, visible(lo, hi), softmax_scale)
    return out


def _cached_block(q, K, V, mask, softmax_scale):  # q (B, n, Hq, D), mask (B, n, Lk) -> (B, n, Hq, D)
    B, n, Hq, D = q.shape
    Hkv, Lk = K.shape[1], K.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, n, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * n, D)  # row g * n + i
    m = mask[:, None, None].expand(B, 1, G, n, Lk).reshape(B, 1, G * n, Lk)  # (B, 1, G n, Lk): O(n Lk) per block
    o = F.scaled_dot_product_attention(qg, K, V, attn_mask=m, scale=softmax_scale)  # (B, Hkv, G n, D)
    return o.reshape(B, Hkv, G, n, D).permute(0, 3, 1, 2, 4).reshape(B, n, Hq, D)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        Hq, Hkv, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(H, Hq * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, Hkv * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(Hq * D, H, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def qkv(self, x, cos, sin):  # x (..., H) -> q (..., Hq, D), k/v (..., Hkv, D), RoPE applied
        c = self.cfg
        q = self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cu_seqlens, attn_fn):  # packed: x (T, H)
        q, k, v = self.qkv(x, cos, sin)
        o = attn_fn(q, k, v, cu_seqlens, softmax_scale=1.0 / math.sqrt(self.cfg.head_dim))  # (T, Hq, D)
        return self.o_proj(o.flatten(-2))

    def forward_cached(self, x, cos, sin, cache: KVCache, layer: int):  # x (B, S, H)
        q, k, v = self.qkv(x, cos, sin)  # (B, S, Hq|Hkv, D)
        K, V = cache.write(layer, k, v)  # (B, Hkv, Lk, D) x2
        o = cached_attention(q, K, V, cache.visible, 1.0 / math.sqrt(self.cfg.head_dim))  # (B, S, Hq, D)
        return self.o_proj(o.flatten(-2))


class MLP(nn.Module):  # SwiGLU
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, attend):  # attend: normed hidden -> attention output (packed or cached)
        h = h + attend(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))
