"""Triton backend for the block computation of attention_blocks.py: the same protocol as TorchBlocks (forward /
backward over a list of Segments, branch_forward / branch_backward), one kernel launch per ring step over all
segments. The algorithm, the layout and the merge are unchanged; only the block arithmetic moves into a kernel.

FlashAttention-2's online softmax, with the scores in base 2 (exp2 is one instruction on a GPU; exp is exp2 and a
multiply), for one query row over key tiles t = 1, 2, ...:

    1. s2_j = (tau log2 e) q.k_j                     (base-2 score: exp(tau q.k_j) = 2^s2_j)
    2. m <- max(m_old, max_j s2_j),  a = 2^(m_old - m)
       l <- a l + sum_j 2^(s2_j - m),   acc <- a acc + sum_j 2^(s2_j - m) v_j
    3. out = acc / l,   lse = ln 2 (m + log2 l)      (natural log: what the merge rule and the ring expect)

The partial result already in (out, lse) enters as tile 0 with m = lse log2 e, l = 1, acc = out (a finished partial
result is exactly that), so step 2 *is* the merge rule (4-5 of attention_blocks.py) and the kernel merges in place.
Backward recomputes p_ij = 2^(s2_ij - lse_i log2 e) and adds the terms 6-10 of attention_blocks.py: one kernel over
query tiles for dQ, one over key tiles for dK and dV (each program owns its rows: no atomics, deterministic).

Work list: each Segment (q0, q1, k0, k1, causal) is cut into row tiles on the host (a small int32 table, one row per
program: rows [s, e) of the tiled side and the segment's bounds), so one launch covers every sequence of a packed
batch. Causal tiles stop at the diagonal; the longest tiles go first so the tail of the launch is short.

    python attention_triton.py                        # GPU: the ring (cp = 1, 2 as threads) vs dense fp64, bf16
    TRITON_INTERPRET=1 python attention_triton.py     # CPU: the same through Triton's interpreter, fp32
    pytest -q tests/test_attention_triton.py          # vs TorchBlocks block by block, and end to end

Importing this module registers backend "triton". On CPU set TRITON_INTERPRET=1 *before* importing it (triton.jit
decides at decoration time whether a kernel is compiled or interpreted).

Letters: T query rows, Tk key rows, Hq / Hkv heads, G = Hq / Hkv (GQA group), D head dim (BD: D rounded up to a power
of 2), P branch entries per anchor, BM / BN query / key rows per tile, BR rows per branch program.
"""
from __future__ import annotations

import functools
import threading

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the message names the backend: this module is imported when backend="triton" is requested
    raise ImportError('backend="triton" needs the triton package (pip install triton; on a CPU-only machine also set '
                      'TRITON_INTERPRET=1 to run its interpreter)') from e

from attention_blocks import host_to_device, register_backend

LOG2E = 1.4426950408889634  # log2(e): natural -> base 2 (host side: the base-2 softmax scale tau log2 e)
# kernels may read only constexpr globals
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(0.6931471805599453)  # ln(2): base 2 -> natural
INF = tl.constexpr(float("inf"))


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile(Tiles):
    """Row program_id(0) of the work table: rows [s, e) of the tiled side, segment start a0 of that side, and the
    other side's rows [b0, b1) and the causal flag."""
    t = Tiles + tl.program_id(0) * 6
    return tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4), tl.load(t + 5)


@triton.jit
def _fwd_kernel(Q, K, V, Out, Lse, Tiles, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sl_t,
                qk_scale, G, D, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    qs, qe, q0, k0, k1, causal = _tile(Tiles)  # query rows [qs, qe) of segment (q0.., k0..k1, causal)
    h = tl.program_id(1)
    hk = h // G  # GQA: query head h reads key/value head h // G
    qi = qs + tl.arange(0, BM)  # (BM,) query rows
    d = tl.arange(0, BD)
    q_ok = qi < qe
    io = qi.to(tl.int64)[:, None] * so_t + h * so_h + d[None, :]  # (BM, BD) offsets into Out; int64: T*Hq*D > 2^31
    mq = q_ok[:, None] & (d[None, :] < D)
    q = tl.load(Q + qi.to(tl.int64)[:, None] * sq_t + h * sq_h + d[None, :], mask=mq, other=0.0)  # (BM, BD)
    # tile 0 = the partial result already merged here (previous ring steps): m = lse log2 e, l = 1, acc = out
    lse_old = tl.load(Lse + qi.to(tl.int64) * sl_t + h, mask=q_ok, other=-INF)
    m = lse_old * LOG2E_K  # (BM,) running max, base 2
    l = tl.where(lse_old == -INF, 0.0, 1.0)  # (BM,) running sum of 2^(s2 - m)
    acc = tl.load(Out + io, mask=mq, other=0.0)  # (BM, BD) fp32
    k_hi = k1
    if causal != 0:  # aligned starts: query offset i sees key offsets <= i, so the tile stops at its last row's
        k_hi = tl.minimum(k1, k0 + (qe - q0))
    for ks in range(k0, k_hi, BN):
        kj = ks + tl.arange(0, BN)  # (BN,) key rows
        k_ok = kj < k_hi
        kt = tl.load(K + kj.to(tl.int64)[None, :] * sk_t + hk * sk_h + d[:, None],
                     mask=k_ok[None, :] & (d[:, None] < D), other=0.0)  # (BD, BN)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BM, BN) base-2 scores
        # -inf, not a large negative: 2^-inf is exactly 0, so a masked key has weight exactly 0
        ok = k_ok[None, :] & ((causal == 0) | (kj[None, :] - k0 <= qi[:, None] - q0))
        s = tl.where(ok, s, -INF)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == -INF, 0.0, m_new)  # a row with nothing yet: 2^(-inf - 0) = 0, never -inf - -inf
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + kj.to(tl.int64)[:, None] * sv_t + hk * sv_h + d[None, :],
                    mask=k_ok[:, None] & (d[None, :] < D), other=0.0)  # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # p in v's dtype (FA2)
        m = m_new
    tl.store(Out + io, acc / tl.where(l == 0.0, 1.0, l)[:, None], mask=mq)
    tl.store(Lse + qi.to(tl.int64) * sl_t + h, (m + tl.log2(l)) * LN2_K, mask=q_ok)  # natural log


@triton.jit
def _bwd_dq_kernel(Q, K, V, dO, Lse, Delta, dQ, Tiles, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sl_t,
                   qk_scale, sm_scale, G, D, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   PRECISION: tl.constexpr):
    """dq_i += tau sum_j ds_ij k_j over one query tile; dO and dQ share the accumulator layout (sg_*)."""
    qs, qe, q0, k0, k1, causal = _tile(Tiles)
    h = tl.program_id(1)
    hk = h // G
    qi = qs + tl.arange(0, BM)
    d = tl.arange(0, BD)
    q_ok = qi < qe
    mq = q_ok[:, None] & (d[None, :] < D)
    ig = qi.to(tl.int64)[:, None] * sg_t + h * sg_h + d[None, :]
    q = tl.load(Q + qi.to(tl.int64)[:, None] * sq_t + h * sq_h + d[None, :], mask=mq, other=0.0)  # (BM, BD)
    do = tl.load(dO + ig, mask=mq, other=0.0).to(q.dtype)  # fp32 accumulator -> input dtype for the MMA (FA2)
    lse2 = tl.load(Lse + qi.to(tl.int64) * sl_t + h, mask=q_ok, other=INF) * LOG2E_K
    lse2 = tl.where(lse2 == -INF, INF, lse2)  # a row that saw no key: p = 2^(s2 - inf) = 0, not NaN
    delta = tl.load(Delta + qi.to(tl.int64) * sl_t + h, mask=q_ok, other=0.0)
    dq = tl.zeros((BM, BD), dtype=tl.float32)
    k_hi = k1
    if causal != 0:
        k_hi = tl.minimum(k1, k0 + (qe - q0))
    for ks in range(k0, k_hi, BN):
        kj = ks + tl.arange(0, BN)
        k_ok = kj < k_hi
        mk = k_ok[None, :] & (d[:, None] < D)
        kt = tl.load(K + kj.to(tl.int64)[None, :] * sk_t + hk * sk_h + d[:, None], mask=mk, other=0.0)  # (BD, BN)
        vt = tl.load(V + kj.to(tl.int64)[None, :] * sv_t + hk * sv_h + d[:, None], mask=mk, other=0.0)  # (BD, BN)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        ok = k_ok[None, :] & ((causal == 0) | (kj[None, :] - k0 <= qi[:, None] - q0))
        p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)  # (BM, BN) step 6, with the *final* lse
        dp = tl.dot(do, vt, input_precision=PRECISION)  # dO_i . v_j
        ds = p * (dp - delta[:, None])  # step 8
        dq += tl.dot(ds.to(q.dtype), tl.trans(kt), input_precision=PRECISION)  # step 9
    tl.store(dQ + ig, tl.load(dQ + ig, mask=mq, other=0.0) + dq * sm_scale, mask=mq)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dO, Lse, Delta, dK, dV, Tiles, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sl_t,
                     sd_t, sd_h, qk_scale, sm_scale, G, D, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                     PRECISION: tl.constexpr):
    """dv_j += sum_i p_ij dO_i, dk_j += tau sum_i ds_ij q_i over one key tile, all G query heads of its kv head
    (summed here, so no atomics). dK and dV share the accumulator layout (sd_*)."""
    ks, ke, k0, q0, q1, causal = _tile(Tiles)  # key rows [ks, ke) of segment (q0..q1, k0.., causal)
    hk = tl.program_id(1)
    kj = ks + tl.arange(0, BN)
    d = tl.arange(0, BD)
    k_ok = kj < ke
    mk = k_ok[:, None] & (d[None, :] < D)
    k = tl.load(K + kj.to(tl.int64)[:, None] * sk_t + hk * sk_h + d[None, :], mask=mk, other=0.0)  # (BN, BD)
    v = tl.load(V + kj.to(tl.int64)[:, None] * sv_t + hk * sv_h + d[None, :], mask=mk, other=0.0)
    dk = tl.zeros((BN, BD), dtype=tl.float32)
    dv = tl.zeros((BN, BD), dtype=tl.float32)
    q_lo = q0
    if causal != 0:  # the first query that sees key ks has the same offset in its segment
        q_lo = q0 + (ks - k0)
    for g in range(G):
        h = hk * G + g
        for qs in range(q_lo, q1, BM):
            qi = qs + tl.arange(0, BM)
            q_ok = qi < q1
            mq = q_ok[:, None] & (d[None, :] < D)
            q = tl.load(Q + qi.to(tl.int64)[:, None] * sq_t + h * sq_h + d[None, :], mask=mq, other=0.0)  # (BM, BD)
            do = tl.load(dO + qi.to(tl.int64)[:, None] * sg_t + h * sg_h + d[None, :], mask=mq, other=0.0).to(k.dtype)
            lse2 = tl.load(Lse + qi.to(tl.int64) * sl_t + h, mask=q_ok, other=INF) * LOG2E_K
            delta = tl.load(Delta + qi.to(tl.int64) * sl_t + h, mask=q_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN)
            ok = q_ok[:, None] & k_ok[None, :] & ((causal == 0) | (kj[None, :] - k0 <= qi[:, None] - q0))
            p = tl.where(ok & (lse2[:, None] != -INF), tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(k.dtype)), do, input_precision=PRECISION)  # step 7
            ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(k.dtype)), q, input_precision=PRECISION)  # step 10
    idk = kj.to(tl.int64)[:, None] * sd_t + hk * sd_h + d[None, :]
    tl.store(dK + idk, tl.load(dK + idk, mask=mk, other=0.0) + dk * sm_scale, mask=mk)
    tl.store(dV + idk, tl.load(dV + idk, mask=mk, other=0.0) + dv, mask=mk)


@triton.jit
def _branch_fwd_kernel(Q, BK, BV, Out, Lse, T, P, sq_t, sq_h, sb_t, sb_p, sb_h, so_t, so_h, sl_t, qk_scale, G, D,
                       BR: tl.constexpr, BD: tl.constexpr):
    """Row i over the P branch entries of its own anchor: per-row dot products (no MMA: every row has its own keys),
    the same online softmax in base 2 over p = 0..P-1, in fp32."""
    ti = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    hk = h // G
    d = tl.arange(0, BD)
    m2 = (ti < T)[:, None] & (d[None, :] < D)
    t64 = ti.to(tl.int64)[:, None]
    q = tl.load(Q + t64 * sq_t + h * sq_h + d[None, :], mask=m2, other=0.0).to(tl.float32)  # (BR, BD)
    m = tl.full((BR,), -INF, tl.float32)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    for p in range(P):  # P >= 1: after the first entry m is finite, so no -inf - -inf
        ib = t64 * sb_t + p * sb_p + hk * sb_h + d[None, :]
        s = tl.sum(q * tl.load(BK + ib, mask=m2, other=0.0).to(tl.float32), 1) * qk_scale  # (BR,)
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        e = tl.exp2(s - m_new)
        l = l * alpha + e
        acc = acc * alpha[:, None] + e[:, None] * tl.load(BV + ib, mask=m2, other=0.0).to(tl.float32)
        m = m_new
    tl.store(Out + t64 * so_t + h * so_h + d[None, :], acc / l[:, None], mask=m2)
    tl.store(Lse + ti.to(tl.int64) * sl_t + h, (m + tl.log2(l)) * LN2_K, mask=ti < T)


@triton.jit
def _branch_bwd_kernel(Q, BK, BV, dO, Lse, Delta, dQ, dBK, dBV, T, P, sq_t, sq_h, sb_t, sb_p, sb_h, sg_t, sg_h, sl_t,
                       sdb_t, sdb_p, sdb_h, qk_scale, sm_scale, G, D, BR: tl.constexpr, BD: tl.constexpr):
    """Steps 6-10 for the branch, one program per (row tile, kv head): it owns dbk/dbv of its rows (summed over the
    G query heads) and dq of its rows for those heads."""
    ti = tl.program_id(0) * BR + tl.arange(0, BR)
    hk = tl.program_id(1)
    d = tl.arange(0, BD)
    t_ok = ti < T
    m2 = t_ok[:, None] & (d[None, :] < D)
    t64 = ti.to(tl.int64)[:, None]
    for p in range(P):
        ib = t64 * sb_t + p * sb_p + hk * sb_h + d[None, :]
        bk = tl.load(BK + ib, mask=m2, other=0.0).to(tl.float32)  # (BR, BD)
        bv = tl.load(BV + ib, mask=m2, other=0.0).to(tl.float32)
        dbk = tl.zeros((BR, BD), tl.float32)
        dbv = tl.zeros((BR, BD), tl.float32)
        for g in range(G):
            h = hk * G + g
            q = tl.load(Q + t64 * sq_t + h * sq_h + d[None, :], mask=m2, other=0.0).to(tl.float32)
            ig = t64 * sg_t + h * sg_h + d[None, :]
            do = tl.load(dO + ig, mask=m2, other=0.0)
            lse2 = tl.load(Lse + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=INF) * LOG2E_K
            delta = tl.load(Delta + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=0.0)
            prob = tl.exp2(tl.sum(q * bk, 1) * qk_scale - lse2)  # (BR,) step 6
            dbv += prob[:, None] * do
            ds = prob * (tl.sum(do * bv, 1) - delta)
            dbk += ds[:, None] * q
            tl.store(dQ + ig, tl.load(dQ + ig, mask=m2, other=0.0) + (sm_scale * ds)[:, None] * bk, mask=m2)
        idb = t64 * sdb_t + p * sdb_p + hk * sdb_h + d[None, :]
        tl.store(dBK + idb, dbk * sm_scale, mask=m2)
        tl.store(dBV + idb, dbv, mask=m2)


# ----------------------------------------------------------------------------------------------- host-side wrapper
try:
    from triton.runtime.interpreter import InterpretedFunction
    INTERPRETED = isinstance(_fwd_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 was set before this import
except ImportError:  # pragma: no cover - a triton without the interpreter module
    INTERPRETED = False
# The interpreter patches triton.language globally while a kernel runs, so two threads (the ranks of the in-process
# ThreadRing) must not interpret at once. Compiled kernels need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch(kernel, grid, *args, **meta):
    if INTERPRETED:
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _launch_groups(segments):
    """Segments one launch may take together. A program read-modify-writes its rows of out/lse/dq (query side) or
    dk/dv (key side), so the segments of one launch must not share query rows nor key rows; the ring's segments
    never do (one per sequence). Anything else (a hand-made overlapping list) runs one launch per segment."""
    segs = [s for s in segments if s.q1 > s.q0 and s.k1 > s.k0]

    def disjoint(spans):
        spans = sorted(spans)
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    if disjoint([(s.q0, s.q1) for s in segs]) and disjoint([(s.k0, s.k1) for s in segs]):
        return [segs] if segs else []
    return [[s] for s in segs]


def tile_table(segments, side: str, rows: int, device) -> torch.Tensor:
    """The work list: (n_tiles, 6) int32, one row per program, longest first. side="q": tiles of `rows` query rows,
    each row (qs, qe, q0, k0, k1, causal); side="k": tiles of key rows, (ks, ke, k0, q0, q1, causal).
    Built on the host once per (segments, side, rows, device) -- i.e. per (local cu_seqlens, ring step, side) -- and
    cached on the device: the other layers, and the backward, reuse it without a copy or a sync."""
    return _tile_table(tuple(segments), side, rows, torch.device(device))


@functools.lru_cache(maxsize=512)
def _tile_table(segments, side, rows, device):
    seg = torch.tensor([tuple(s) for s in segments], dtype=torch.int64).reshape(-1, 5)  # (q0, q1, k0, k1, causal)
    if side == "k":
        seg = seg[:, [2, 3, 0, 1, 4]]  # the tiled side first: (k0, k1, q0, q1, causal)
    a0, a1, b0, b1, causal = seg.unbind(1)
    n = (a1 - a0 + rows - 1) // rows  # tiles per segment
    first = torch.cumsum(n, 0) - n
    j = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)  # tile index within its segment
    a0, a1, b0, b1, causal = (x.repeat_interleave(n) for x in (a0, a1, b0, b1, causal))
    s = a0 + j * rows
    e = torch.minimum(s + rows, a1)
    if side == "q":  # causal: the tile's last query sees keys up to its own offset
        work = torch.where(causal.bool(), torch.minimum(b1 - b0, e - a0), b1 - b0)
    else:  # causal: the tile's first key is seen by the queries from its own offset on
        work = torch.where(causal.bool(), b1 - b0 - (s - a0), b1 - b0)
    table = torch.stack([s, e, a0, b0, b1, causal], 1)[torch.argsort(work, descending=True, stable=True)]
    return host_to_device(table.to(torch.int32), device)


class TritonBlocks:
    """The block kernel protocol of attention_blocks.TorchBlocks on Triton kernels. Inputs fp32/fp16/bf16 (fp32 uses
    exact-fp32 "ieee" dots, not TF32), accumulators (out, lse, dq, dk, dv) fp32.

    Tiles: fwd_tiles = (BM, BN) query x key rows for the forward; bwd_tiles = (outer, inner): the dQ kernel holds
    `outer` query rows and steps over `inner` key rows, the dK/dV kernel holds `outer` key rows and steps over `inner`
    query rows; branch_rows = BR. None picks by row size (untuned, FlashAttention-style): rows of <= 256 bytes (bf16
    with D <= 128) get the fused-attention tutorial's 128x64 forward and 128x32 backward tiles; wider rows (fp32, or
    D > 128) get 64x32, so K/V stages still fit in shared memory and the fp32 dK/dV accumulators in registers.
    Block dims must be >= 16 for tl.dot on a GPU."""

    def __init__(self, fwd_tiles=None, bwd_tiles=None, branch_rows=64):
        self.fwd_tiles, self.bwd_tiles, self.branch_rows = fwd_tiles, bwd_tiles, branch_rows

    def config(self, q):
        """(fwd tiles, bwd tiles, launch options fwd, launch options bwd, constexprs) for inputs like q."""
        BD = max(16, triton.next_power_of_2(q.shape[-1]))
        wide = BD * q.element_size() > 256
        fwd = self.fwd_tiles or ((64, 32) if wide else (128, 64))
        bwd = self.bwd_tiles or ((64, 32) if wide else (128, 32))
        opts_f = dict(num_warps=4 if wide else 8, num_stages=2 if wide else 3)
        opts_b = dict(num_warps=8, num_stages=2)  # 8 warps: the (outer, D) fp32 dK and dV tiles live in registers
        const = dict(BD=BD, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # ignored for 16-bit inputs
        return tuple(fwd), tuple(bwd), opts_f, opts_b, const

    @staticmethod
    def _check(q, *accumulators):
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f'backend="triton": inputs must be fp32, fp16 or bf16, got {q.dtype} '
                            f'(fp64 runs on backend="torch")')
        if INTERPRETED and q.dtype == torch.bfloat16:  # it would return garbage, not fail
            raise TypeError('backend="triton" under TRITON_INTERPRET=1: Triton\'s interpreter computes bf16 tl.dot on '
                            'the raw bit patterns (triton-lang/triton#11584); use fp16/fp32 there, bf16 on a GPU')
        if q.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError('backend="triton" got CPU tensors but its kernels are compiled for a GPU; on CPU set '
                               'TRITON_INTERPRET=1 before importing attention_triton (Triton\'s interpreter)')
        for a in accumulators:
            if a.dtype != torch.float32 or a.stride(-1) != 1:
                raise TypeError(f'backend="triton": accumulators must be fp32 with a contiguous last dim, got '
                                f'{a.dtype} strides {a.stride()}')

    def forward(self, q, k, v, segments, scale, out, lse):
        """Merge attention of q (T, Hq, D) over k, v (Tk, Hkv, D) along `segments` into out (T, Hq, D), lse (T, Hq)."""
        self._check(q, out, lse)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        (BM, BN), _, opts, _, const = self.config(q)
        Hq, G, D = q.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        for group in _launch_groups(segments):
            tiles = tile_table(group, "q", BM, q.device)
            _launch(_fwd_kernel, (tiles.shape[0], Hq), q, k, v, out, lse, tiles, q.stride(0), q.stride(1),
                    k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                    scale * LOG2E, G, D, BM=BM, BN=BN, **const, **opts)

    def backward(self, q, k, v, dout, lse, delta, segments, scale, dq, dk, dv):
        """Add this block's terms (steps 6-10) to dq (T, Hq, D) and dk, dv (Tk, Hkv, D)."""
        self._check(q, dout, lse, delta, dq, dk, dv)
        if dout.stride() != dq.stride() or dk.stride() != dv.stride() or lse.stride() != delta.stride():
            raise ValueError('backend="triton": dout/dq, dk/dv and lse/delta must share their layouts')
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        _, (outer, inner), _, opts, const = self.config(q)
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dq.stride(0),
                  dq.stride(1), lse.stride(0))
        for group in _launch_groups(segments):
            tiles = tile_table(group, "q", outer, q.device)
            _launch(_bwd_dq_kernel, (tiles.shape[0], Hq), q, k, v, dout, lse, delta, dq, tiles, *common,
                    scale * LOG2E, scale, Hq // Hkv, D, BM=outer, BN=inner, **const, **opts)
            tiles = tile_table(group, "k", outer, q.device)
            _launch(_bwd_dkdv_kernel, (tiles.shape[0], Hkv), q, k, v, dout, lse, delta, dk, dv, tiles, *common,
                    dk.stride(0), dk.stride(1), scale * LOG2E, scale, Hq // Hkv, D, BM=inner, BN=outer, **const,
                    **opts)

    def branch_forward(self, q, bk, bv, scale, acc):
        """q (T, Hq, D), bk, bv (T, P, Hkv, D) -> out (T, Hq, D), lse (T, Hq) in `acc` (fp32)."""
        T, Hq, D = q.shape
        out, lse = q.new_empty(T, Hq, D, dtype=acc), q.new_empty(T, Hq, dtype=acc)
        self._check(q, out, lse)
        q, bk, bv = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, bk, bv))
        if bk.stride() != bv.stride():
            bk, bv = bk.contiguous(), bv.contiguous()
        BR = self.branch_rows
        _launch(_branch_fwd_kernel, (triton.cdiv(T, BR), Hq), q, bk, bv, out, lse, T, bk.shape[1], q.stride(0),
                q.stride(1), bk.stride(0), bk.stride(1), bk.stride(2), out.stride(0), out.stride(1), lse.stride(0),
                scale * LOG2E, Hq // bk.shape[2], D, BR=BR, BD=self.config(q)[4]["BD"])
        return out, lse

    def branch_backward(self, q, bk, bv, dout, lse, delta, scale, dq):
        """Steps 6-10 for the branch: adds to dq (T, Hq, D); returns dbk, dbv (T, P, Hkv, D) in dq's dtype."""
        self._check(q, dout, lse, delta, dq)
        if dout.stride() != dq.stride() or lse.stride() != delta.stride():
            raise ValueError('backend="triton": dout/dq and lse/delta must share their layouts')
        q, bk, bv = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, bk, bv))
        if bk.stride() != bv.stride():
            bk, bv = bk.contiguous(), bv.contiguous()
        T, Hq, D = q.shape
        P, Hkv = bk.shape[1], bk.shape[2]
        dbk = torch.empty(bk.shape, dtype=dq.dtype, device=q.device)  # contiguous: dbk, dbv share strides
        dbv = torch.empty_like(dbk)
        BR = self.branch_rows
        _launch(_branch_bwd_kernel, (triton.cdiv(T, BR), Hkv), q, bk, bv, dout, lse, delta, dq, dbk, dbv, T, P,
                q.stride(0), q.stride(1), bk.stride(0), bk.stride(1), bk.stride(2), dq.stride(0), dq.stride(1),
                lse.stride(0), dbk.stride(0), dbk.stride(1), dbk.stride(2), scale * LOG2E, scale, Hq // Hkv, D,
                BR=BR, BD=self.config(q)[4]["BD"])
        return dbk, dbv


register_backend("triton", TritonBlocks())


# ------------------------------------------------------------------------------------------------------------- demo
if __name__ == "__main__":
    from attention_cp import reference_branch_attention, ring_branch_attention
    from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard, zigzag_unshard
    from ring import run_ranks

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bf16 dot
    g = torch.Generator().manual_seed(0)
    for cp in (1, 2):
        cu = pad_for_cp(cu_seqlens_from_lengths([37, 5, 64]), cp).cu_seqlens
        T, Hq, Hkv, D, P = int(cu[-1]), 4, 2, 16, 3
        full = [torch.randn(*s, generator=g, dtype=torch.float64) for s in
                ((T, Hq, D), (T, Hkv, D), (T, Hkv, D), (T, P, Hkv, D), (T, P, Hkv, D))]
        want = reference_branch_attention(*full[:3], cu, *full[3:])[0]

        def rank(ring):
            mine = [zigzag_shard(x, cu, cp, ring.rank).to(dev, dtype) for x in full]
            return ring_branch_attention(*mine[:3], cu, *mine[3:], group=ring, backend="triton").double().cpu()

        got = zigzag_unshard(run_ranks(cp, rank, timeout=600), cu)
        print(f"triton {dev} {dtype} cp={cp}: max |out - dense fp64| = {float((got - want).abs().max()):.2e}")
