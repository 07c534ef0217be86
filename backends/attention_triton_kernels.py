"""The Triton kernels of attention_triton.py (which launches them and documents the algorithm): FlashAttention-2's
forward and backward over a work table of tiles, and the branch part, in base 2 (exp2 is one GPU instruction).

    forward, per query row over key tiles:  s2_j = (tau log2 e) q.k_j;  m <- max(m, s2);
                                            l <- 2^(m_old - m) l + sum_j 2^(s2_j - m)
    backward:  p_ij = 2^(s2_ij - lse_i log2 e);  dv += p dO;  ds = p (dO.v - delta);  dq += tau ds k;  dk += tau ds q

A causal segment's rows see keys j < end(i): the aligned diagonal, or per-row ends (the queries of anchors; the ends
are non-decreasing: a query tile stops at its last row's end, and a key tile's queries start at the first row whose
end lies past the tile's first key, found by binary search).
Every program owns the rows it writes (query tiles for out/lse/dq, key tiles for dk/dv, row tiles for the branch),
adds to them once at its end, and so needs no atomics. Import through attention_triton (TRITON_INTERPRET=1 must be set
before the first import on a CPU).

Letters: BM / BN query / key rows per tile, BD head dim rounded up to a power of 2, BR rows per branch program,
G = Hq / Hkv, P branch entries per anchor.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): natural -> base 2 (host side: the base-2 softmax scale tau log2 e)
# kernels may read only constexpr globals
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(0.6931471805599453)  # ln(2): base 2 -> natural
INF = tl.constexpr(float("inf"))


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile(Tiles):
    """Row program_id(0) of the work table: rows [s, e) of the tiled side, segment start a0 of that side, and the
    other side's rows [b0, b1) and the causal kind (0 none, 1 the aligned diagonal, 2 per-row key ends in Ends)."""
    t = Tiles + tl.program_id(0) * 6
    return tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4), tl.load(t + 5)


@triton.jit
def _row_ends(qi, q_ok, q0, k0, k1, causal, Ends):
    """(BM,) end (exclusive) of the key rows each query row sees: k1 (causal 0: all), k0 + offset + 1 (1: the aligned
    diagonal) or Ends[row] (2: per-row key ends, the queries of anchors). Loaded once per query tile."""
    # unless causal == 2 every row reads Ends[0] (the stand-in holds one element) and ignores it
    end = tl.load(Ends + tl.where(causal == 2, qi, 0), mask=q_ok, other=0).to(tl.int32)
    end = tl.where(causal == 1, k0 + (qi - q0) + 1, end)
    return tl.where(causal == 0, k1, end)


@triton.jit
def _key_hi(qe, q0, k0, k1, causal, Ends):
    """End of the keys any query row in [.., qe) sees: the last row's (end(i) is non-decreasing)."""
    k_hi = k1
    if causal == 1:  # aligned starts: query offset i sees key offsets <= i, so the tile stops at its last row's
        k_hi = tl.minimum(k1, k0 + (qe - q0))
    if causal == 2:
        k_hi = tl.minimum(k1, tl.load(Ends + qe - 1).to(tl.int32))
    return k_hi


@triton.jit
def _query_lo(ks, q0, q1, k0, causal, Ends):
    """First query row that sees key row ks: its own offset (aligned), or the first with Ends > ks (binary search:
    Ends is non-decreasing within a segment)."""
    q_lo = q0
    if causal == 1:
        q_lo = q0 + (ks - k0)
    if causal == 2:
        hi = q1
        while q_lo < hi:
            mid = (q_lo + hi) // 2
            if tl.load(Ends + mid) > ks:
                hi = mid
            else:
                q_lo = mid + 1
    return q_lo


@triton.jit
def _fwd_kernel(Q, K, V, Out, Lse, Tiles, Ends, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sl_t,
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
    k_hi = _key_hi(qe, q0, k0, k1, causal, Ends)
    end = _row_ends(qi, q_ok, q0, k0, k1, causal, Ends)  # (BM,) key rows j < end are visible
    for ks in range(k0, k_hi, BN):
        kj = ks + tl.arange(0, BN)  # (BN,) key rows
        k_ok = kj < k_hi
        kt = tl.load(K + kj.to(tl.int64)[None, :] * sk_t + hk * sk_h + d[:, None],
                     mask=k_ok[None, :] & (d[:, None] < D), other=0.0)  # (BD, BN)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BM, BN) base-2 scores
        # -inf, not a large negative: 2^-inf is exactly 0, so a masked key has weight exactly 0
        s = tl.where(k_ok[None, :] & (kj[None, :] < end[:, None]), s, -INF)
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
def _bwd_dq_kernel(Q, K, V, dO, Lse, Delta, dQ, Tiles, Ends, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sl_t,
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
    k_hi = _key_hi(qe, q0, k0, k1, causal, Ends)
    end = _row_ends(qi, q_ok, q0, k0, k1, causal, Ends)  # (BM,) key rows j < end are visible
    for ks in range(k0, k_hi, BN):
        kj = ks + tl.arange(0, BN)
        k_ok = kj < k_hi
        mk = k_ok[None, :] & (d[:, None] < D)
        kt = tl.load(K + kj.to(tl.int64)[None, :] * sk_t + hk * sk_h + d[:, None], mask=mk, other=0.0)  # (BD, BN)
        vt = tl.load(V + kj.to(tl.int64)[None, :] * sv_t + hk * sv_h + d[:, None], mask=mk, other=0.0)  # (BD, BN)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        ok = k_ok[None, :] & (kj[None, :] < end[:, None])
        p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)  # (BM, BN) step 6, with the *final* lse
        dp = tl.dot(do, vt, input_precision=PRECISION)  # dO_i . v_j
        ds = p * (dp - delta[:, None])  # step 8
        dq += tl.dot(ds.to(q.dtype), tl.trans(kt), input_precision=PRECISION)  # step 9
    tl.store(dQ + ig, tl.load(dQ + ig, mask=mq, other=0.0) + dq * sm_scale, mask=mq)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dO, Lse, Delta, dK, dV, Tiles, Ends, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sl_t,
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
    q_lo = _query_lo(ks, q0, q1, k0, causal, Ends)  # queries before it see no key of this tile
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
            end = _row_ends(qi, q_ok, q0, k0, ke, causal, Ends)  # causal 0: k_ok bounds it
            ok = q_ok[:, None] & k_ok[None, :] & (kj[None, :] < end[:, None])
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
def _branch_bwd_dq_kernel(Q, BK, BV, dO, Lse, Delta, dQ, T, P, sq_t, sq_h, sb_t, sb_p, sb_h, sg_t, sg_h, sl_t,
                          qk_scale, sm_scale, G, D, BR: tl.constexpr, BD: tl.constexpr):
    """Steps 6, 8, 9 for the branch, one program per (row tile, query head): dq of its rows stays in registers over
    the P entries and is added to dQ once at the end (no read-modify-write inside the loop, which would rely on
    barriers the compiler does not promise between a store and a later load by another thread)."""
    ti = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    hk = h // G
    d = tl.arange(0, BD)
    t_ok = ti < T
    m2 = t_ok[:, None] & (d[None, :] < D)
    t64 = ti.to(tl.int64)[:, None]
    ig = t64 * sg_t + h * sg_h + d[None, :]
    q = tl.load(Q + t64 * sq_t + h * sq_h + d[None, :], mask=m2, other=0.0).to(tl.float32)  # (BR, BD)
    do = tl.load(dO + ig, mask=m2, other=0.0)
    lse2 = tl.load(Lse + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=INF) * LOG2E_K
    delta = tl.load(Delta + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=0.0)
    dq = tl.zeros((BR, BD), tl.float32)
    for p in range(P):
        ib = t64 * sb_t + p * sb_p + hk * sb_h + d[None, :]
        bk = tl.load(BK + ib, mask=m2, other=0.0).to(tl.float32)  # (BR, BD)
        bv = tl.load(BV + ib, mask=m2, other=0.0).to(tl.float32)
        prob = tl.exp2(tl.sum(q * bk, 1) * qk_scale - lse2)  # (BR,) step 6
        ds = prob * (tl.sum(do * bv, 1) - delta)  # step 8
        dq += ds[:, None] * bk  # step 9
    tl.store(dQ + ig, tl.load(dQ + ig, mask=m2, other=0.0) + dq * sm_scale, mask=m2)


@triton.jit
def _branch_bwd_dkv_kernel(Q, BK, BV, dO, Lse, Delta, dBK, dBV, T, P, sq_t, sq_h, sb_t, sb_p, sb_h, sg_t, sg_h, sl_t,
                           sdb_t, sdb_p, sdb_h, qk_scale, sm_scale, G, D, BR: tl.constexpr, BD: tl.constexpr):
    """Steps 6, 7, 8, 10 for the branch, one program per (row tile, kv head): dbk/dbv of entry p of its rows, summed
    over the G query heads in registers and written once (each program owns its rows: no atomics)."""
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
            do = tl.load(dO + t64 * sg_t + h * sg_h + d[None, :], mask=m2, other=0.0)
            lse2 = tl.load(Lse + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=INF) * LOG2E_K
            delta = tl.load(Delta + ti.to(tl.int64) * sl_t + h, mask=t_ok, other=0.0)
            prob = tl.exp2(tl.sum(q * bk, 1) * qk_scale - lse2)  # (BR,) step 6
            dbv += prob[:, None] * do  # step 7
            dbk += (prob * (tl.sum(do * bv, 1) - delta))[:, None] * q  # steps 8, 10
        idb = t64 * sdb_t + p * sdb_p + hk * sdb_h + d[None, :]
        tl.store(dBK + idb, dbk * sm_scale, mask=m2)
        tl.store(dBV + idb, dbv, mask=m2)
