"""Dense attention over packed sequences, padded and batched: the single-process kernels and the oracles' fast twin.

A packed batch (S sequences, T tokens, `cu_seqlens`) is scattered into an (S, L_max) grid so that ONE batched softmax
replaces a Python loop over sequences; pad rows sit after each sequence, so the causal mask keeps them out of every
real query. Both functions build the full (S, Hq, L, L) scores -- O(L^2) memory -- so they are for short rollouts and
tests; the long-context path is attention_cp.ring_branch_attention (a ring of one without CP).

    padded_causal_attention   the policy's causal attention      == modeling.layers.packed_causal_attention
    padded_branch_attention   the draft's TTT attention (trunk + branch, one softmax)
                                                                 == attention_cp.reference_branch_attention

    python -m pytest -q tests/test_rl_loop.py -k padded          # both against their dense references

Letters: T packed tokens, S sequences, L the longest sequence, Hq / Hkv query / kv heads, D head dim, P branch entries.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from branch_mask import seq_ids
from parallel.ring import as_ring


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
