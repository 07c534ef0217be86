"""Dense attention over packed sequences, padded and batched: the single-process kernels and the oracles' fast twin.

A packed batch (S sequences, T tokens, `cu_seqlens`) is scattered into an (S, L_max) grid so that ONE batched softmax
replaces a Python loop over sequences; pad rows sit after each sequence, so the causal mask keeps them out of every
real query. Both functions build the full (S, Hq, L, L) scores -- O(L^2) memory -- so they are for short rollouts and
tests; the long-context path is attention_cp.ring_branch_attention (a ring of one without CP).

    padded_causal_attention   the policy's causal attention      == modeling.layers.packed_causal_attention
    padded_branch_attention   the draft's TTT attention (trunk + branch, one softmax)
                                                                 == attention_cp.reference_branch_attention
    auto_causal_attention     padded while its scores fit PADDED_MAX_SCORES_MIB, else packed_causal_attention
    auto_branch_attention     padded while its scores fit, else ring_branch_attention as a ring of one (blockwise:
                              O(L) memory); what the warm-ups and the control arms run, so that a long rollout never
                              forms (S, Hq, L, L + P) scores, and tiny batches keep the fast batched kernel

    python -m pytest -q tests/test_rl_loop.py -k padded          # both against their dense references

Letters: T packed tokens, S sequences, L the longest sequence, Hq / Hkv query / kv heads, D head dim, P branch entries.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention_cp import ring_branch_attention
from branch_mask import seq_ids
from parallel.host_copy import host_cu
from modeling.layers import packed_causal_attention
from parallel.ring import as_ring

PADDED_MAX_SCORES_MIB = 64.0  # the padded kernels' (S, Hq, L, L + P) fp32 scores at most this; beyond, blockwise


def padded_fits(cu_seqlens, heads: int, P: int = 0, max_mib: float = None) -> bool:
    """Would the padded kernels' scores, S sequences x heads x L_max x (L_max + P) fp32, stay within max_mib MiB
    (None: PADDED_MAX_SCORES_MIB)? Read from the host copy of cu_seqlens (branch_mask.host_cu): no device sync."""
    max_mib = PADDED_MAX_SCORES_MIB if max_mib is None else max_mib
    cu = host_cu(cu_seqlens)
    L = max(b - a for a, b in zip(cu, cu[1:]))
    return 4 * (len(cu) - 1) * heads * L * (L + P) <= max_mib * 2**20


def auto_causal_attention(q, k, v, cu_seqlens, softmax_scale):
    """padded_causal_attention for small batches (one batched SDPA), modeling.layers.packed_causal_attention (SDPA
    per sequence with is_causal: the fused kernels, no L x L tensor) once the padded scores would pass the budget."""
    if padded_fits(cu_seqlens, q.shape[1]):
        return padded_causal_attention(q, k, v, cu_seqlens, softmax_scale)
    return packed_causal_attention(q, k, v, cu_seqlens, softmax_scale)


def auto_branch_attention(q, k, v, cu_seqlens, branch_k=None, branch_v=None, *, group=None, softmax_scale=None,
                          backend="torch"):
    """padded_branch_attention for small batches, attention_cp.ring_branch_attention (a ring of one: the blockwise
    kernel of `backend`) once the padded scores would pass the budget. The same arguments as both."""
    P = 0 if branch_k is None else branch_k.shape[1]
    if padded_fits(cu_seqlens, q.shape[1], P):
        return padded_branch_attention(q, k, v, cu_seqlens, branch_k, branch_v, group=group,
                                       softmax_scale=softmax_scale, backend=backend)
    return ring_branch_attention(q, k, v, cu_seqlens, branch_k, branch_v, group=group, softmax_scale=softmax_scale,
                                 backend=backend)


def padded_causal_attention(q, k, v, cu_seqlens, softmax_scale):
    """Same result as modeling.layers.packed_causal_attention, computed as ONE batched SDPA over sequences padded to
    the longest.

    q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D). Wastes (L_max - L_s) rows per sequence but avoids the per-sequence
    Python loop, about 2x faster for many short rollouts on CPU. Pad rows sit after each sequence, so the causal mask
    already keeps them out of every real query."""
    T, Hq, D = q.shape
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    S, L = lens.numel(), int(lens.max())
    sid = seq_ids(cu_seqlens).to(q.device)
    pos = torch.arange(T, device=q.device) - cu[:-1].to(q.device)[sid]

    def pad(x):  # (T, h, D) -> (S, h, L, D)
        out = x.new_zeros((S, L) + tuple(x.shape[1:]))
        out[sid, pos] = x
        return out.transpose(1, 2)

    rep = Hq // k.shape[1]
    kp, vp = pad(k).repeat_interleave(rep, 1), pad(v).repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(pad(q), kp, vp, is_causal=True, scale=softmax_scale)  # (S, Hq, L, D)
    return o.transpose(1, 2)[sid, pos]


def padded_branch_attention(q, k, v, cu_seqlens, branch_k=None, branch_v=None, *, group=None, softmax_scale=None,
                            backend="torch"):
    """Single-process drop-in for attention_cp.ring_branch_attention (the draft's TTT attention), padded and batched.

    Query at anchor i sees trunk keys j <= i of its sequence and the P branch entries at i, in ONE softmax:
        s = [q K_trunk^T (causal) | q . branch_k]  (S, Hq, L, L+P) -> softmax -> [P_trunk V | sum_p P_p branch_v]
    Plain autograd; O(S L (L+P)) scores. No CP (group None or size 1): the ring version is the one that shards."""
    if group is not None and as_ring(group).size != 1:
        raise ValueError("padded_branch_attention: no CP (group must be None or of size 1); use ring_branch_attention")
    T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    S, L = lens.numel(), int(lens.max())
    sid = seq_ids(cu_seqlens).to(q.device)
    pos = torch.arange(T, device=q.device) - cu[:-1].to(q.device)[sid]
    rep = Hq // k.shape[1]

    def pad(x):  # (T, ...) -> (S, L, ...)
        out = x.new_zeros((S, L) + tuple(x.shape[1:]))
        out[sid, pos] = x
        return out

    qp = pad(q).transpose(1, 2)  # (S, Hq, L, D)
    kp, vp = (pad(x).repeat_interleave(rep, 2).transpose(1, 2) for x in (k, v))  # (S, Hq, L, D)
    s = (qp @ kp.transpose(-1, -2)) * scale  # (S, Hq, L, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    if branch_k is None or branch_k.shape[1] == 0:
        o = torch.softmax(s, -1) @ vp
        return o.transpose(1, 2)[sid, pos]
    bk, bv = (x.repeat_interleave(rep, 2) for x in (branch_k, branch_v))  # (T, P, Hq, D)
    sb = torch.einsum("thd,tphd->htp", q, bk) * scale  # (Hq, T, P)
    sb = pad(sb.permute(1, 0, 2)).transpose(1, 2)  # (S, Hq, L, P)
    p = torch.softmax(torch.cat([s, sb], -1), -1)  # (S, Hq, L, L+P): one normalisation over trunk and branch
    o = (p[..., :L] @ vp).transpose(1, 2)[sid, pos]  # (T, Hq, D)
    pb = p[..., L:].transpose(1, 2)[sid, pos]  # (T, Hq, P)
    return o + torch.einsum("thp,tphd->thd", pb, bv)
