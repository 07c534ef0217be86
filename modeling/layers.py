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


@functools.lru_cache(maxsize=None)
def _mm_out_dtype_ok() -> bool:
    """Does this torch's CUDA mm take out_dtype (bf16 / fp16 in, fp32 out; torch >= 2.8)? Probed once."""
    try:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def linear_f32(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """(..., H) @ (V, H)^T -> (..., V) logits in fp32 at least: the LM head of every log-prob that GRPO compares
    (the rollout's, fused_logprob's). A bf16 matmul accumulates in fp32 but rounds its output to bf16: ~2^-9 relative,
    0.02-0.04 on a logit of 10, straight into log p. The product of two bf16 numbers is exact in fp32, so the fp32
    matmul of the same bf16 weights loses nothing. CUDA without autograd (decode): torch.mm(..., out_dtype=fp32), bf16
    tensor cores and no fp32 copy of W; otherwise both operands cast to fp32 (a (V, H) fp32 temporary)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return at_least_f32(F.linear(x, W))
    grad = torch.is_grad_enabled() and (x.requires_grad or W.requires_grad)
    if x.is_cuda and W.dtype == x.dtype and not grad and _mm_out_dtype_ok():
        return torch.mm(x.reshape(-1, x.shape[-1]), W.t(), out_dtype=torch.float32).reshape(*x.shape[:-1], W.shape[0])
    return F.linear(x.float(), W.float())


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
        K, V, mask = cache.write(layer, k, v)  # (B, Hkv, Lk, D) x2, mask (B, S, Lk)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask[:, None], enable_gqa=True,
                                           scale=1.0 / math.sqrt(self.cfg.head_dim))  # GQA without copying K/V
        return self.o_proj(o.transpose(1, 2).flatten(-2))


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
