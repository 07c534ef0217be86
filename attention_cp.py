"""Zigzag ring attention over packed sequences, fused with the draft's local branch attention; exact fwd and bwd.

A draft's query belongs to an *anchor* a (a trunk row) and attends to the *trunk* keys j of a's sequence up to the
anchor, and to the *branch*: the P entries of anchor a itself. Each anchor holds W such queries. Two families:

    TTT (EAGLE-3):   pass d at anchor a, W = 1, trunk j <= a (the anchor visible), branch = passes 2..d at a;
    DFlash blocks:   the block at anchor a, W = B slots, trunk j < a, branch = the block's own B entries (W x W,
                     bidirectional): every query of anchor a sees all P entries of a.

The policy's causal attention is the first with no branch (every row its own anchor). Under CP (zigzag layout,
branch_mask.py) the trunk is spread over the ranks and travels a ring; an anchor's queries and branch sit on the rank
that holds the anchor, so the branch stays local and a query follows the ring by its anchor's position. Per rank r:

    (a) step 0: each query over my own trunk K/V up to its anchor, j <= a or j < a (positions increase locally);
    (b) step t = 1..cp-1: the K/V of rank src = r - t arrive (sent during step t-1, so the hop overlaps compute);
       if src < r every query sees src's first chunk only; if src > r only the queries whose anchor is in my second
       chunk see all of src's rows (zigzag: every step after the first is half a block, the work the same on every
       rank);
    (c) branch: each query over its anchor's P entries, locally, once;
    (d) all partial (out, lse) merged exactly with the one rule below (merge_, steps 4-5).

`ring_branch_attention` takes trunk-aligned queries (q row i belongs to anchor i, j <= i: the policy, TTT);
`anchor_branch_attention` any anchors, W, and either convention. They share the ring and the kernels: the W queries
of an anchor ride as extra query heads of their kv head (GQA), and a query's trunk limit is the kernel's per-row key
end (attention_blocks.KeyEnds: a + 1 or a). A query that sees nothing (j < a at a sequence's first row, no branch)
ends with out 0, lse -inf, and no gradient.

The block computation (TorchBlocks; FlashAttention's notation). For one query row q over a key set K, scale tau:

    1. s_j = tau * q.k_j            2. lse = log sum_j exp(s_j)            3. out = sum_j exp(s_j - lse) v_j

(step 2 in its stable form per tile: m = max_j s_j, l = sum_j exp(s_j - m), lse = m + log l, out = (sum_j ... v_j) / l).
Partial results over disjoint key sets A and B merge exactly (naive: recompute over A u B; stable form):

    4. lse = logaddexp(lse_A, lse_B)            5. out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

An empty part has lse = -inf and weight exactly 0, so merging it changes nothing and never makes a NaN. Every partial
result (a tile, a ring step, the local branch) is folded in with this one rule, in >= fp32 (fp64 stays fp64).
Backward (FlashAttention-2), given the *final* lse and delta_i = dO_i.O_i - dlse_i (dlse: gradient reaching lse):

    6. p_ij = exp(s_ij - lse_i)     7. dv_j += sum_i p_ij dO_i     8. ds_ij = p_ij (dO_i.v_j - delta_i)
    9. dq_i += tau sum_j ds_ij k_j      10. dk_j += tau sum_i ds_ij q_i

so blocks need no merging going backward: each adds its own terms. Only tile x tile scores ever exist. The backward
runs the same ring: K/V travel again, and each block's dK/dV travels *with* it (diagram at _RingBranchAttention.
backward); dQ and the branch grads stay local. No mask and no full-length K/V ever exist: per rank O((L/cp)(P+1))
memory (with anchors: O(L/cp + N W + N P), N this rank's anchors) plus two ring buffers. World size 1 runs the same
code without messages.

Backends: a kernel is any object with forward / backward / branch_forward / branch_backward as in TorchBlocks
(attention_blocks.py; with `key_ends = True` when it takes per-row key ends, which anchor_branch_attention needs:
torch and triton do, flash-attn refuses with an error naming backend=);
`register_backend("triton", kernel)` makes `ring_branch_attention(..., backend="triton")` use it (backends/ holds the
Triton and flash-attn kernels, imported on first request). A kernel may also have prepare_backward(q, dout, delta) ->
kernel, called once per backward before the ring loop: work that depends on the rows only (and any host check it
needs) goes there, not into every ring step. No kernel reads the device inside a ring step: host-side tables are
cached per layout (host_to_device).

    python attention_cp.py    # the chunks each step of a cp = 2 ring sees, then cp = 1..4 as threads vs dense
    torchrun --standalone --nproc_per_node=4 attention_cp.py    # the error figures over real gloo processes

References: ring attention (Liu et al. 2023), zigzag load balancing (zhuzilin/ring-flash-attention; Llama 3 §3.3.2),
FlashAttention-2's lse backward, EAGLE-3 training-time test (Li et al. 2025), DFlash block drafts (arXiv 2602.06036).

Letters: T = T_local rows on this rank, S sequences, Hq / Hkv heads, G = Hq / Hkv (GQA group), D head dim, P branch
entries per anchor, N anchors on this rank, W queries per anchor, C = rows of one zigzag chunk of a sequence, cp ranks
in the group, r this rank, tq / tk tile rows.
"""
from __future__ import annotations

import bisect
import importlib
import itertools
import math
import os

import torch

from attention_blocks import KeyEnds, Segment, TorchBlocks, host_to_device, merge_  # noqa: F401  (re-exported)
from branch_mask import anchor_attention_mask, branch_attention_mask, check_cp_padded
from parallel.host_copy import host_cu
from parallel.ring import as_ring


BACKENDS = {"torch": TorchBlocks()}


def register_backend(name: str, kernel) -> None:
    """Make `backend=name` available to ring_branch_attention (e.g. a Triton or flash-attn kernel file calls this)."""
    BACKENDS[name] = kernel


_LAZY = {"triton": "backends.attention_triton", "flash": "backends.attention_flash"}  # GPU kernels: on first request


def get_backend(name: str):
    if name not in BACKENDS and name in _LAZY:
        importlib.import_module(_LAZY[name])  # registers itself; a missing triton / flash_attn names the backend
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not registered; known: {sorted(BACKENDS)} "
                         f"(add one with attention_cp.register_backend)")
    return BACKENDS[name]


# ------------------------------------------------------------------------------------------------------- the ring
def ring_branch_attention(q, k, v, cu_seqlens, branch_k=None, branch_v=None, *, group=None, softmax_scale=None,
                          return_lse=False, backend="torch"):
    """q (T, Hq, D), k, v (T, Hkv, D), branch_k/v (T, P, Hkv, D) or None: this rank's zigzag shard.
    cu_seqlens int32 (S+1): the *global, CP-padded* boundaries. group: None (no CP), a torch ProcessGroup, or a
    ring.Ring. Returns out (T, Hq, D) in q's dtype, and lse (T, Hq) (natural log, fp32; fp64 for fp64 inputs)
    if return_lse. Both are differentiable. As the policy's attention under CP:
    model(tokens_shard, cu_seqlens, position_ids=positions_shard, attn_fn=partial(ring_branch_attention, group=g))."""
    ring = as_ring(group)
    kernel = get_backend(backend)
    _check_inputs(q, k, v, cu_seqlens, branch_k, branch_v, ring.size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if branch_k is not None and branch_k.shape[1] == 0:
        branch_k = branch_v = None
    out, lse = _RingBranchAttention.apply(q, k, v, branch_k, branch_v, cu_seqlens, ring, scale, kernel, None)
    return (out, lse) if return_lse else out


def anchor_branch_attention(q, k, v, cu_seqlens, anchors, branch_k=None, branch_v=None, *, anchor_visible=True,
                            group=None, softmax_scale=None, return_lse=False, backend="torch"):
    """The general branch: W query rows per anchor. q (N, W, Hq, D): the W queries of each of this rank's N anchors;
    anchors int64 (N,): each anchor's *local* trunk row on this rank's zigzag shard, non-decreasing
    (branch_mask.shard_anchors maps global rows to ranks); k, v (T_local, Hkv, D): the trunk, travelling the ring as
    in ring_branch_attention; branch_k/v (N, P, Hkv, D) or None: anchor n's P entries, seen by all W of its queries.
    Query (n, w) sees the trunk keys j of its anchor's sequence with j <= a_n (anchor_visible: TTT) or j < a_n (a
    DFlash block), wherever they live in the ring, plus the P entries of anchor n. Returns out (N, W, Hq, D) in q's
    dtype [, lse (N, W, Hq), fp32 / fp64]; a query that sees no key gets out 0, lse -inf and no gradient.
    Memory O(N W) per rank plus ring_branch_attention's: the W queries ride as extra query heads of their kv head."""
    ring = as_ring(group)
    kernel = get_backend(backend)
    if not getattr(kernel, "key_ends", False):
        raise ValueError(f"backend={backend!r} has no per-anchor key limits (anchor_branch_attention); "
                         f"use backend='torch' or 'triton'")
    _check_inputs(q, k, v, cu_seqlens, branch_k, branch_v, ring.size, anchors)
    N, W, Hq, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if branch_k is not None and branch_k.shape[1] == 0:
        branch_k = branch_v = None
    rows = host_cu(anchors)  # the anchors on the host (any 1-D int tensor; read once per tensor): tiles, segments
    ends = KeyEnds(tuple(a + 1 for a in rows), anchors + 1) if anchor_visible else KeyEnds(rows, anchors)
    # (N, W, Hkv, G, D) -> (N, Hkv W G, D), kv-head major: the W queries become extra GQA heads of their kv head
    qf = q.reshape(N, W, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(N, Hkv * W * (Hq // Hkv), D)
    out, lse = _RingBranchAttention.apply(qf, k, v, branch_k, branch_v, cu_seqlens, ring, scale, kernel, (rows, ends))
    out = out.reshape(N, Hkv, W, Hq // Hkv, D).transpose(1, 2).reshape(N, W, Hq, D)
    lse = lse.reshape(N, Hkv, W, Hq // Hkv).transpose(1, 2).reshape(N, W, Hq)
    return (out, lse) if return_lse else out


def step_segments(local_cu, step: int, rank: int, cp: int, anchors=None):
    """Which query rows see which rows of the K/V held at `step` (they came from rank src = rank - step). A query
    row is an anchor: anchors (host ints, non-decreasing) are their local trunk rows; None: row i is its own anchor.
    A query follows its anchor's position, so the rule is the trunk's own."""
    src, segs = (rank - step) % cp, []
    for o, e in zip(local_cu[:-1], local_cu[1:]):
        C = (e - o) // 2  # a sequence: my rows [o, o+C) = chunk r, [o+C, e) = chunk 2cp-1-r; src's alike
        # its queries: [a0, a2), of which [a1, a2) have their anchor in my second chunk
        a0, a1, a2 = (o, o + C, e) if anchors is None else (bisect.bisect_left(anchors, x) for x in (o, o + C, e))
        if a2 == a0:
            continue
        if step == 0:  # causal: up to the anchor (aligned diagonal, or the kernel's KeyEnds)
            segs.append(Segment(a0, a2, o, e, True))
        elif src < rank:  # src's chunk src precedes both of mine; its chunk 2cp-1-src follows both
            segs.append(Segment(a0, a2, o, o + C, False))
        elif a2 > a1:  # src's two chunks lie between my two: only my second chunk sees them
            segs.append(Segment(a1, a2, o, e, False))
    return segs


class _RingBranchAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bk, bv, cu_seqlens, ring, scale, kernel, anchors):
        """q (Nq, Hq, D) query rows; anchors None (row i of q is trunk row i) or (host rows, KeyEnds) of the rows."""
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        local_cu = [c // ring.size for c in host_cu(cu_seqlens)]  # host ints (read once per tensor): no sync here
        r, n = ring.rank, ring.size
        rows, kw = (None, {}) if anchors is None else (anchors[0], {"ends": anchors[1]})
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=acc)
        k_cur, v_cur, k_nxt, v_nxt = k, v, None, None
        for step in range(n):
            if step + 1 < n:  # post the next hop first: the transfer runs while this block computes
                k_nxt, v_nxt = torch.empty_like(k), torch.empty_like(v)
                hop = ring.exchange([((r + 1) % n, k_cur), ((r + 1) % n, v_cur)],
                                    [((r - 1) % n, k_nxt), ((r - 1) % n, v_nxt)], "ring attention K/V hop")
            kernel.forward(q, k_cur, v_cur, step_segments(local_cu, step, r, n, rows), scale, out, lse, **kw)
            if step + 1 < n:
                hop.wait()  # sync point: the next block must be here before the next step
                k_cur, v_cur, hop = k_nxt, v_nxt, None  # dropping the handle frees the block just sent
        del k_cur, v_cur, k_nxt, v_nxt  # free the ring buffers before the branch allocates
        if bk is not None:
            merge_(out, lse, *kernel.branch_forward(q, bk, bv, scale, acc))
        out = out.to(q.dtype)  # saved as returned, in q's dtype, and lse in fp32 (as FlashAttention keeps O and lse)
        ctx.save_for_backward(q, k, v, bk, bv, out, lse)
        ctx.local_cu, ctx.ring, ctx.scale, ctx.kernel, ctx.rows, ctx.kw = local_cu, ring, scale, kernel, rows, kw
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, bk, bv, out, lse = ctx.saved_tensors
        ring, scale, kernel, local_cu, rows, kw = ctx.ring, ctx.scale, ctx.kernel, ctx.local_cu, ctx.rows, ctx.kw
        r, n = ring.rank, ring.size
        acc = lse.dtype  # fp32 (fp64 for fp64 inputs)
        dout = dout.to(acc)
        delta = (dout * out).sum(-1)  # (T, Hq) in acc: dO.O, minus the gradient reaching lse (d lse / d s_ij = p_ij)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros_like(q, dtype=acc)
        if hasattr(kernel, "prepare_backward"):  # per-row work (and its host check) once, outside the ring loop
            kernel = kernel.prepare_backward(q, dout, delta)
        # dK/dV hand-off, cp = 3. B_s is the K/V block rank s owns; at step t rank r holds B_(r-t) and adds its terms
        # (+r) to the partial dK/dV that arrived with it; every "->" is one hop to rank r+1, overlapping the next step:
        #            step 0          step 1          step 2          final hop
        #   rank 0:  B0 +r0   ->     B2 +r0 (+r2)    B1 +r0 (+r1 r2) B0 home (from rank 2) with every term
        #   rank 1:  B1 +r1   ->     B0 +r1 (+r0)    B2 +r1 (+r2 r0) B1 home with every term
        #   rank 2:  B2 +r2   ->     B1 +r2 (+r1)    B0 +r2 (+r0 r1) B2 home with every term
        k_cur, v_cur, k_nxt, v_nxt, incoming = k, v, None, None, None
        for step in range(n):
            if step + 1 < n:
                k_nxt, v_nxt = torch.empty_like(k), torch.empty_like(v)
                hop = ring.exchange([((r + 1) % n, k_cur), ((r + 1) % n, v_cur)],
                                    [((r - 1) % n, k_nxt), ((r - 1) % n, v_nxt)], "ring attention backward K/V hop")
            dk_blk, dv_blk = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            kernel.backward(q, k_cur, v_cur, dout, lse, delta, step_segments(local_cu, step, r, n, rows), scale,
                            dq, dk_blk, dv_blk, **kw)
            if incoming is not None:  # this block's dK/dV summed by the ranks that held it before me
                incoming[0].wait()
                dk_blk += incoming[1]
                dv_blk += incoming[2]
                incoming = None  # frees the buffers (and my previous block, whose send has completed)
            if n > 1:  # pass it on; it overlaps my next step. After step n-1 this hop brings it home to its owner.
                dk_in, dv_in = torch.empty_like(dk_blk), torch.empty_like(dv_blk)
                incoming = (ring.exchange([((r + 1) % n, dk_blk), ((r + 1) % n, dv_blk)],
                                          [((r - 1) % n, dk_in), ((r - 1) % n, dv_in)], "ring attention dK/dV hop"),
                            dk_in, dv_in)
            if step + 1 < n:
                hop.wait()
                k_cur, v_cur, hop = k_nxt, v_nxt, None
        if n > 1:
            incoming[0].wait()
            dk_blk, dv_blk = incoming[1], incoming[2]  # my own K/V's gradient, every rank's terms included
        del k_cur, v_cur, k_nxt, v_nxt, incoming  # ring buffers go before the branch grads arrive: a lower peak
        dbk = dbv = None
        if bk is not None:
            dbk, dbv = kernel.branch_backward(q, bk, bv, dout, lse, delta, scale, dq)
            dbk, dbv = dbk.to(bk.dtype), dbv.to(bv.dtype)
        return (dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype), dbk, dbv, None, None, None, None, None)


def _check_inputs(q, k, v, cu_seqlens, bk, bv, cp, anchors=None):
    """q (T, Hq, D) without anchors, (N, W, Hq, D) with; k, v (T, Hkv, D); branch (q rows, P, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"{type(x).__name__} {getattr(x, 'dtype', '')}"
            raise TypeError(f"{name}: expected a floating-point tensor, got {got}")
    want_q = "(T_local, Hq, D)" if anchors is None else "(N anchors, W, Hq, D)"
    if q.dim() != (3 if anchors is None else 4) or (anchors is not None and q.shape[1] < 1):
        raise ValueError(f"q: expected {want_q}{'' if anchors is None else ' with W >= 1'}, got shape {tuple(q.shape)}")
    N, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    T = N if anchors is None else k.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != T or x.shape[2] != D:
            raise ValueError(f"{name}: expected (T_local={T}, Hkv, D={D}), got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: shapes differ, {tuple(k.shape)} vs {tuple(v.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"q: Hq={Hq} heads is not a multiple of k's Hkv={k.shape[1]} (GQA)")
    rows = "T_local" if anchors is None else "N"
    for name, x in (("branch_k", bk), ("branch_v", bv)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor ({rows}, P, Hkv, D) or None, got {type(x).__name__} "
                            f"(softmax_scale is keyword-only)")
    if (bk is None) != (bv is None):
        raise ValueError("branch_k, branch_v: pass both or neither")
    if bk is not None:
        want = (N, bk.shape[1] if bk.dim() == 4 else -1, k.shape[1], D)
        for name, x in (("branch_k", bk), ("branch_v", bv)):
            if x.dim() != 4 or tuple(x.shape) != want:
                raise ValueError(f"{name}: expected ({rows}={N}, P, Hkv={k.shape[1]}, D={D}) with P equal for "
                                 f"branch_k and branch_v, got shape {tuple(x.shape)}")
    tensors = [("q", q), ("k", k), ("v", v)] + ([("branch_k", bk), ("branch_v", bv)] if bk is not None else [])
    for name, x in tensors[1:]:
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name}: dtype/device {x.dtype}/{x.device} differs from q's {q.dtype}/{q.device}")
    check_cp_padded(cu_seqlens, cp)
    total = host_cu(cu_seqlens)[-1]
    if total != T * cp:
        raise ValueError(f"{'q' if anchors is None else 'k'}: {T} rows, but cu_seqlens holds {total} tokens, which a "
                         f"CP group of size {cp} splits into {total // cp} per rank; is `group` the group these "
                         f"shards were cut for?")
    if anchors is not None:
        _check_anchors(anchors, N, T, q.device)


def _check_anchors(anchors, N, T, device):
    if not isinstance(anchors, torch.Tensor) or anchors.dtype != torch.int64 or anchors.dim() != 1:
        raise TypeError(f"anchors: expected an int64 tensor (N,), got {type(anchors).__name__} "
                        f"{getattr(anchors, 'dtype', '')} {tuple(getattr(anchors, 'shape', ()))}")
    if anchors.shape[0] != N or anchors.device != device:
        raise ValueError(f"anchors: expected (N={N},) on {device} (one per row of q), got "
                         f"{tuple(anchors.shape)} on {anchors.device}")
    rows = host_cu(anchors)  # the host copy the ring uses anyway: read once per tensor
    if rows and (min(rows) < 0 or max(rows) >= T or any(b < a for a, b in zip(rows, rows[1:]))):
        raise ValueError(f"anchors: expected this rank's local trunk rows in [0, T_local={T}), non-decreasing "
                         f"(branch_mask.shard_anchors gives them), got {list(rows[:16])}{' ...' if N > 16 else ''}")


def reference_branch_attention(q, k, v, cu_seqlens, branch_k=None, branch_v=None, softmax_scale=None):
    """The oracle: dense masked attention over the full (unsharded) batch with the mask from branch_mask.
    O(T^2 (1+P)) memory. Returns (out (T, Hq, D), lse (T, Hq)); plain autograd."""
    T, Hq, D = q.shape
    P = 0 if branch_k is None else branch_k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    keys = torch.cat([k] + [branch_k[:, p] for p in range(P)])  # ((1+P) T, Hkv, D): [trunk | branch 0 | ...]
    vals = torch.cat([v] + [branch_v[:, p] for p in range(P)])
    G = Hq // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(G, 1)) * scale  # (Hq, T, (1+P) T)
    s = s.masked_fill(~branch_attention_mask(cu_seqlens, P).to(q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vals.repeat_interleave(G, 1))
    return out, lse.transpose(0, 1)


def reference_anchor_attention(q, k, v, cu_seqlens, anchors, branch_k=None, branch_v=None, *, anchor_visible=True,
                               softmax_scale=None):
    """The oracle of anchor_branch_attention: dense masked attention over the full (unsharded) batch with
    branch_mask.anchor_attention_mask. anchors (N,): *global* packed (padded) rows; q (N, W, Hq, D), k, v (T, Hkv, D),
    branch (N, P, Hkv, D) or None. O(N W (T + N P)) memory. Returns (out (N, W, Hq, D), lse (N, W, Hq)); a query with
    no visible key gets out 0, lse -inf, and plain autograd gives it zero gradients (no NaN)."""
    N, W, Hq, D = q.shape
    P = 0 if branch_k is None else branch_k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    G = Hq // k.shape[1]
    keys, vals = (torch.cat([x] + ([b.flatten(0, 1)] if P else [])).repeat_interleave(G, 1)
                  for x, b in ((k, branch_k), (v, branch_v)))  # (T + N P, Hq, D): [trunk | anchor 0's P | ...]
    mask = anchor_attention_mask(cu_seqlens, anchors.cpu(), W, P, anchor_visible).to(q.device)  # (N W, T + N P)
    empty = ~mask.any(-1)  # (N W,) rows with no key: scored over a dummy 0 so that autograd never sees -inf - -inf
    s = torch.einsum("qhd,khd->hqk", q.flatten(0, 1), keys) * scale  # (Hq, N W, T + N P)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).masked_fill(empty[:, None], 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vals)
    lse = lse.masked_fill(empty, float("-inf")).transpose(0, 1)
    return out.reshape(N, W, Hq, D), lse.reshape(N, W, Hq)


# ------------------------------------------------------------------------------------------------------------- demo
def ring_schedule(cp: int, C: int = 2) -> dict:
    """What step_segments gives one sequence of 2cp chunks of C rows: {(rank, step): {my query chunk: {key chunk:
    "all" | "causal" (its lower triangle, the diagonal chunk) | pairs seen}}}, chunks by global index (zigzag: local
    rows [0, C) are chunk r, [C, 2C) chunk 2cp-1-r, and alike for the K/V of src = rank - step)."""
    out = {}
    for rank, step in itertools.product(range(cp), range(cp)):
        chunk = lambda who, row: who if row < C else 2 * cp - 1 - who  # noqa: E731  (local row -> global chunk)
        seen = {chunk(rank, 0): {}, chunk(rank, C): {}}
        for s in step_segments([0, 2 * C], step, rank, cp):
            for i in range(s.q0, s.q1):  # query row i sees key rows [k0, k1), or up to the aligned diagonal
                for j in range(s.k0, min(s.k1, s.k0 + i - s.q0 + 1) if s.causal else s.k1):
                    q, k = seen[chunk(rank, i)], chunk((rank - step) % cp, j)
                    q[k] = q.get(k, 0) + 1
        out[rank, step] = {q: {k: {C * C: "all", C * (C + 1) // 2: "causal"}.get(n, n) for k, n in ks.items()}
                           for q, ks in seen.items()}
    return out


def print_ring(cp: int = 2, C: int = 2):
    """The ring_schedule of one sequence, rank by rank and step by step."""
    print(f"zigzag ring, cp={cp}: one sequence of {2 * cp * C} rows in {2 * cp} chunks of {C}; rank r holds chunks r "
          f"and {2 * cp - 1}-r and receives the K/V of rank r - t at step t (step_segments)")
    for (rank, step), qs in ring_schedule(cp, C).items():
        src = (rank - step) % cp
        head = f"  rank {rank} (chunks {rank}, {2 * cp - 1 - rank})" if step == 0 else " " * 24
        what = "its own K/V" if step == 0 else f"rank {src}'s chunks {src}, {2 * cp - 1 - src}"
        sees = "; ".join(f"q chunk {q} sees " + (", ".join(f"{k} ({n})" for k, n in sorted(ks.items())) or "nothing")
                         for q, ks in sorted(qs.items()))
        print(f"{head}  step {step}, {what}: {sees}")


def _demo_case(rank, cp, group):
    """Same seeded batch on every rank; returns max |error| of out, lse and all grads of this rank's shard."""
    from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard
    g = torch.Generator().manual_seed(0)
    cu = pad_for_cp(cu_seqlens_from_lengths([37, 5, 64]), cp).cu_seqlens
    T, Hq, Hkv, D, P = int(cu[-1]), 4, 2, 16, 3
    full = [torch.randn(T, Hq, D, generator=g, dtype=torch.float64)] + \
           [torch.randn(T, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2)] + \
           [torch.randn(T, P, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2)]
    dout = torch.randn(T, Hq, D, generator=g, dtype=torch.float64)
    ref = [x.clone().requires_grad_() for x in full]
    out_r, lse_r = reference_branch_attention(*ref[:3], cu, *ref[3:])
    (out_r * dout).sum().backward()
    shard = lambda x: zigzag_shard(x, cu, cp, rank)  # noqa: E731
    mine = [shard(x).requires_grad_() for x in full]
    out, lse = ring_branch_attention(*mine[:3], cu, *mine[3:], group=group, return_lse=True)
    (out * shard(dout)).sum().backward()
    pairs = [(out, out_r), (lse, lse_r)] + [(m.grad, x.grad) for m, x in zip(mine, ref)]
    return max(float((a - shard(b)).abs().max()) for a, b in ((a.detach(), b.detach()) for a, b in pairs))


def _demo_blocks(rank, cp, group):
    """DFlash-shaped: blocks of W = 4 queries at every 7th row, trunk j < a, branch = the block's own 4 entries."""
    from branch_mask import cu_seqlens_from_lengths, pad_for_cp, shard_anchors, zigzag_shard
    g = torch.Generator().manual_seed(1)
    cu = pad_for_cp(cu_seqlens_from_lengths([37, 5, 64]), cp).cu_seqlens
    anchors = torch.arange(0, int(cu[-1]), 7)
    N, W, Hq, Hkv, D = len(anchors), 4, 4, 2, 16
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    full = [rnd(N, W, Hq, D), rnd(int(cu[-1]), Hkv, D), rnd(int(cu[-1]), Hkv, D), rnd(N, W, Hkv, D), rnd(N, W, Hkv, D)]
    dout = rnd(N, W, Hq, D)
    ref = [x.clone().requires_grad_() for x in full]
    out_r, lse_r = reference_anchor_attention(*ref[:3], cu, anchors, *ref[3:], anchor_visible=False)
    (out_r * dout).sum().backward()
    local, idx = shard_anchors(anchors, cu, cp, rank)
    trunk = lambda x: zigzag_shard(x, cu, cp, rank)  # noqa: E731
    mine = [(x[idx] if i in (0, 3, 4) else trunk(x)).requires_grad_() for i, x in enumerate(full)]
    out, lse = anchor_branch_attention(*mine[:3], cu, local, *mine[3:], anchor_visible=False, group=group,
                                       return_lse=True)
    (out * dout[idx]).sum().backward()
    pairs = [(out, out_r[idx]), (lse, lse_r[idx])] + [(m.grad, x.grad[idx] if i in (0, 3, 4) else trunk(x.grad))
                                                      for i, (m, x) in enumerate(zip(mine, ref))]
    return max([0.0] + [float((a.detach() - b.detach()).abs().max()) for a, b in pairs if a.numel()])


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one real process per rank
        import torch.distributed as dist
        dist.init_process_group("gloo")
        err = torch.tensor([f(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
                            for f in (_demo_case, _demo_blocks)])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(f"gloo cp={dist.get_world_size()}: max |error| vs dense fp64 (out, lse, 5 grads) = {err[0]:.2e}; "
                  f"blocks (W=4, j < a) = {err[1]:.2e}")
        dist.destroy_process_group()
    else:
        from parallel.ring import run_ranks
        print_ring(2)
        for cp in (1, 2, 3, 4):
            errs = run_ranks(cp, lambda ring: _demo_case(ring.rank, ring.size, ring))
            blocks = run_ranks(cp, lambda ring: _demo_blocks(ring.rank, ring.size, ring))
            print(f"threads cp={cp}: max |error| vs dense fp64 (out, lse, 5 grads) = {max(errs):.2e}; "
                  f"blocks (W=4, j < a) = {max(blocks):.2e}")
