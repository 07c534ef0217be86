"""The draft's TTT loss, streamed: soft cross-entropy against the policy in token chunks, no (T, V) tensor kept.

Pass d at anchor i: q = softmax(W_d norm(h^d_i)) over the draft vocabulary (Vd ids of the target's V), teacher
p = p_{i+d} (the policy at position i+d), restricted and renormalised to the draft's ids, p~ = p[ids] / sum p[ids]:

    ce_i  = -sum_v p~_v log q_v = lse(z) - <p~, z>,    z = W_d x_i,  x_i = norm(h^d_i)      (hard labels: p~ = 1_y)
    dce/dz = q - p~,   dce/dx = (q - p~) W_d,   dce/dW_d = (q - p~)^T x                                    (1)
    metrics: agree_i = [ids[argmax z] == argmax p],   alpha_i = sum_v min(p_v, q_v)   (q = 0 off the draft's ids)

Dense, these need log_softmax(teacher) (T, V), a shifted copy of it per pass, its restriction, the draft's
log_softmax kept for backward and three more (T, V) tensors for the metrics: 12x one (T, V) fp32 tensor at P = 3.
Streamed (`StreamingSoftCE`, the fused linear cross-entropy idea of Liger-Kernel / Cut Your Losses, with a soft
target): rows are taken `chunk` at a time; each chunk computes z, its teacher rows, ce and the metrics. Saved for
backward are only x (T, H) and three (T,) normalisers (lse z, lse of the teacher, log p(ids)); backward recomputes z
and the teacher's rows chunk by chunk and applies (1). Peak: a few (chunk, V) blocks and one (Vd, H) gradient (none
under mixed precision: the chunks add into W's fp32 .main_grad, fused_logprob.WeightGrad).

The teacher p_{i+d} is read by shifting row INDICES (`teacher_index`), never by copying a shifted (T, V) tensor. Under
CP, row i+d may sit on the next zigzag chunk, on another rank: `halo_rows` brings, for every local chunk, the n = P
rows that follow it (n rows per sequence chunk per hop; the logits' rows, or only the (n, H) final hidden states with
the fused teacher). The teacher is either the policy's logits (T, V) (an input) or its final normed hidden
(T, H) and LM-head weight (V, H) (`Teacher(hidden, head=W)`): then no (T, V) tensor exists at all, each chunk's teacher
logits are recomputed from (c, H) rows.

`dense_pass_losses` materialises every (T, V) tensor: the reference the tests compare against (fp64, 1e-10).

    python draft_loss.py       # streaming == dense on a small case; the peak memory of each on T 2048, V 32768

Letters: T rows (this rank's shard under CP), H hidden, V target vocab, Vd draft vocab, c rows of one chunk,
S sequences, n halo rows per chunk (= passes P), d the pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.fused_logprob import DEFAULT_CHUNK_MIB, WeightGrad, budget_rows
from branch_mask import cp_shift, cu_local, seq_lengths
from parallel.host_copy import host_cu
from modeling.layers import at_least_f32


def chunk_rows(vocab_size: int, chunk=None, *, chunk_mib: float = DEFAULT_CHUNK_MIB) -> int:
    """Rows per chunk: `chunk` when given (0 = the dense reference), else the byte budget's (fused_logprob.budget_rows:
    one (rows, V) fp32 block of chunk_mib MiB, the same bytes at every vocabulary size; chunk_mib = 0 -> 0, dense)."""
    if chunk is None:
        return budget_rows(vocab_size, chunk_mib)
    if int(chunk) < 0:
        raise ValueError(f"chunk={chunk}: expected None (auto), 0 (dense reference) or >= 1 rows")
    return int(chunk)


# ------------------------------------------------------------------------------------------- reading p_{i+d} by index
def halo_rows(x, local_cu, n: int, ring):
    """(S, 2, n, ...): for each sequence and each of this rank's two zigzag chunks, the n rows that follow the chunk in
    the global sequence (zeros past the end). x (T_local, ...) is the rank's shard; local_cu = cu_seqlens // cp.

    The successor of chunk r is chunk r+1 (rank r+1's first; for r = cp-1 this rank's own second); the successor of
    chunk 2cp-1-r is chunk 2cp-r (rank r-1's second; none for r = 0). A hop sends each chunk's first n rows, completed
    by its own halo, to the owner of the chunk before it: ceil(n / min C) hops, 2 * S * n rows each."""
    S, r, cp = local_cu.numel() - 1, ring.rank, ring.size
    cu = host_cu(local_cu)  # the host copy (branch_mask.cu_local): no device read
    offs, Cs = list(cu[:-1]), [(b - a) // 2 for a, b in zip(cu, cu[1:])]
    halo = x.new_zeros((S, 2, n) + tuple(x.shape[1:]))
    if not any(Cs) or n == 0:
        return halo
    hops = -(-n // min(C for C in Cs if C))
    for _ in range(hops):
        head = torch.zeros_like(halo)  # first n rows from each chunk's start: its own rows, then its halo
        for s, (o, C) in enumerate(zip(offs, Cs)):
            m = min(C, n)
            for k in (0, 1):
                head[s, k, :m] = x[o + k * C: o + k * C + m]
                head[s, k, m:] = halo[s, k, : n - m]
        first, second = head[:, 0].contiguous(), head[:, 1].contiguous()
        from_next = torch.empty_like(first) if r < cp - 1 else second  # r = cp-1: my second chunk follows my first
        from_prev = torch.empty_like(second) if r > 0 else torch.zeros_like(second)
        sends = ([(r - 1, first)] if r > 0 else []) + ([(r + 1, second)] if r < cp - 1 else [])
        recvs = ([(r + 1, from_next)] if r < cp - 1 else []) + ([(r - 1, from_prev)] if r > 0 else [])
        ring.exchange(sends, recvs, "draft-loss halo").wait()  # sync point: S * n rows each way
        halo = torch.stack([from_next, from_prev], 1)
    return halo


def teacher_index(local_cu, d: int, n: int, cp: int) -> torch.Tensor:
    """(T_local,) int64: where row i+d lives, as an index into [local rows (T_local) ; halo rows (S * 2 * n)].
    Rows whose i+d lies past their sequence get an arbitrary in-range index (the loss masks them)."""
    T = host_cu(local_cu)[-1]  # the host copy (branch_mask.cu_local): no device read
    j = torch.arange(T, device=local_cu.device)
    if cp == 1:  # both chunks of a sequence are contiguous on the only rank: row i+d is row j+d
        return (j + d).clamp(max=max(T - 1, 0))
    lengths = seq_lengths(local_cu)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=j.device), lengths, output_size=T)
    C = (lengths // 2)[seq]
    o = j - local_cu[:-1].long()[seq]  # offset within the sequence's two local chunks
    k = (o >= C).long()
    oc = o - k * C + d  # offset of row i+d from the chunk's start
    return torch.where(oc < C, j + d, T + (seq * 2 + k) * n + (oc - C).clamp(0, n - 1))


class Teacher:
    """The policy's distribution at any row, read by index: rows of `local` (T, X) then of `halo` (R, X).
    X = V (the policy's logits) or H (its final normed hidden, with head (V, H): logits recomputed per chunk).
    `row_map` (T_layout,) maps the layout's rows to rows of `local` (the cp = 1 padding moves rows)."""

    def __init__(self, local, *, head=None, halo=None, row_map=None):
        self.local, self.head, self.row_map = local.detach(), None if head is None else head.detach(), row_map
        self.halo = local.new_zeros((0,) + tuple(local.shape[1:])) if halo is None else halo.detach()

    def logits(self, idx):  # (c,) indices into [layout rows ; halo rows] -> (c, V) fp32 at least
        T = self.local.shape[0] if self.row_map is None else self.row_map.shape[0]
        own = idx < T
        loc = idx.clamp(max=T - 1)
        loc = loc if self.row_map is None else self.row_map[loc]
        x = self.local[loc]  # (c, X)
        if self.halo.shape[0]:
            x = torch.where(own[:, None], x, self.halo[(idx - T).clamp(0, self.halo.shape[0] - 1)])
        return at_least_f32(x if self.head is None else F.linear(x, self.head))

    def dense(self):  # (T_layout, V): every row's logits at once, for the dense reference only
        if self.row_map is None and self.head is None:
            return self.local  # the logits themselves
        return self.logits(torch.arange(self.local.shape[0] if self.row_map is None else self.row_map.shape[0],
                                        device=self.local.device))


def make_teacher(teacher_logits, teacher_hidden, teacher_head, T: int, V: int, cu_seqlens, num_passes: int, ring):
    """Check the teacher arguments and build a Teacher for this rank (with its halo under CP)."""
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError("teacher: pass exactly one of teacher_logits (T, V) or teacher_hidden (T, H) + teacher_head")
    if teacher_logits is not None:
        if teacher_logits.shape != (T, V):
            raise ValueError(f"teacher_logits: expected ({T}, {V}), got {tuple(teacher_logits.shape)}")
        x, head = teacher_logits.detach(), None
    else:
        if teacher_head is None or teacher_head.dim() != 2 or teacher_head.shape[0] != V:
            raise ValueError(f"teacher_head: expected the policy's LM-head weight ({V}, H), got "
                             f"{None if teacher_head is None else tuple(teacher_head.shape)}")
        if teacher_hidden.shape != (T, teacher_head.shape[1]):
            raise ValueError(f"teacher_hidden: expected ({T}, {teacher_head.shape[1]}), got "
                             f"{tuple(teacher_hidden.shape)}")
        x, head = teacher_hidden.detach(), teacher_head.detach()
    halo = None if ring.size == 1 else halo_rows(x, cu_local(cu_seqlens, ring.size), num_passes, ring).flatten(0, 2)
    return Teacher(x, head=head, halo=halo)


# --------------------------------------------------------------------------------------------- the streamed function
class StreamingSoftCE(torch.autograd.Function):
    """sum_i coef_i * ce_i for one pass, chunk by chunk, with the metrics; backward recomputes each chunk.

    x (T, H) = norm(h^d), W (Vd, H), coef (T,) = w_d * valid_i / count_d, valid (T,) bool, src (T,) teacher rows
    (`teacher_index`), labels (T,) draft ids or None (soft), ids (Vd,) target id of each draft id or None (full
    vocabulary), agree_prev (T,) bool. Returns loss (), stats (5,) fp64 [ce, agree, agree & agree_prev, agree_prev,
    alpha] summed over valid rows, agree (T,) bool. Saved for backward: x and three (T,) normalisers (lse of the
    teacher logits, log sum_{v in ids} p_v, lse of z); the teacher's rows are read again from its inputs.
    wg: fused_logprob.WeightGrad(W, x), W passed as wg.weight() (dW into W's fp32 .main_grad under mixed
    precision); None: dW in a buffer, returned to autograd."""

    @staticmethod
    def forward(ctx, x, W, coef, valid, src, labels, ids, agree_prev, teacher, chunk, wg=None):
        T = x.shape[0]
        loss = torch.zeros((), dtype=torch.float64, device=x.device)
        stats = torch.zeros(5, dtype=torch.float64, device=x.device)
        agree = torch.zeros_like(valid)
        norms = torch.zeros(3, T, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)  # (3, T)
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            ce, ag, alpha, norms[:, a:b] = _chunk_forward(x[a:b], W, src[a:b], None if labels is None else labels[a:b],
                                                          ids, teacher)
            m = valid[a:b]
            ce, alpha, md = torch.where(m, ce, 0).double(), torch.where(m, alpha, 0).double(), m.double()
            loss += (ce * coef[a:b].double()).sum()
            stats += torch.stack([(ce * md).sum(), (ag * md).sum(), ((ag & agree_prev[a:b]) * md).sum(),
                                  (agree_prev[a:b] * md).sum(), (alpha * md).sum()])
            agree[a:b] = ag
        ctx.save_for_backward(x, W, coef, valid, src, labels, ids, norms)
        ctx.teacher, ctx.chunk, ctx.wg = teacher, chunk, WeightGrad(W) if wg is None else wg
        ctx.mark_non_differentiable(stats, agree)
        return loss.to(norms.dtype), stats, agree

    @staticmethod
    def backward(ctx, grad_loss, _stats, _agree):
        x, W, coef, valid, src, labels, ids, norms = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # (T, H)
        dW = ctx.wg.begin(ctx.needs_input_grad[1])  # dW (Vd, H) in fp32 at least, or into W's .main_grad
        for a in range(0, x.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, x.shape[0])
            g = _chunk_grad(x[a:b], W, src[a:b], None if labels is None else labels[a:b], ids, ctx.teacher,
                            norms[:, a:b])  # (c, Vd) dce/dz, recomputed
            g.mul_((coef[a:b] * grad_loss).to(g.dtype)[:, None]).masked_fill_(~valid[a:b, None], 0)  # dL/dz
            g = g.to(W.dtype)  # (c, Vd) both GEMMs' operand: rounded once to a 16-bit W's dtype (fp32 block freed)
            if dx is not None:
                dx[a:b] = (g @ W).to(x.dtype)
            if dW is not None:
                dW.add_(g, x[a:b])
        return dx, None if dW is None else dW.result(), None, None, None, None, None, None, None, None, None


def _teacher_p(teacher, src, ids, norms=None):
    """(c, V) teacher logits t -> p = softmax(t) (in place) and pd = p on the draft's ids (c, Vd), with the argmax
    of t and the normalisers lse(t), log sum pd (given in backward: `norms`)."""
    t = teacher.logits(src)  # (c, V)
    t_arg, lse_t = (t.argmax(-1), t.logsumexp(-1)) if norms is None else (None, norms[0])
    p = t.sub_(lse_t[:, None]).exp_()  # (c, V) p
    pd = p if ids is None else p[:, ids]  # (c, Vd) p on the draft's ids
    lse_d = pd.sum(-1).log() if norms is None else norms[1]
    return pd, t_arg, lse_t, lse_d


def _chunk_forward(x, W, src, labels, ids, teacher):
    """One chunk: ce (c,), agree (c,) bool, alpha (c,), normalisers (3, c) [lse(t), log sum pd, lse(z)]."""
    z = at_least_f32(F.linear(x, W))  # (c, Vd) draft logits
    lse = z.logsumexp(-1)
    arg = z.argmax(-1)
    pd, t_arg, lse_t, lse_d = _teacher_p(teacher, src, ids)
    agree = (arg if ids is None else ids[arg]) == t_arg
    if labels is None:  # ce = lse(z) - <p~, z>, p~ = pd / sum pd
        ce = lse - torch.linalg.vecdot(pd, z) / lse_d.exp()
    else:
        ce = lse - z.gather(-1, labels[:, None])[:, 0]
    q = z.sub_(lse[:, None]).exp_()  # (c, Vd) softmax(z), in place
    alpha = torch.minimum(pd, q).sum(-1)
    return ce, agree, alpha, torch.stack([lse_t, lse_d, lse])


def _chunk_grad(x, W, src, labels, ids, teacher, norms):
    """One chunk's dce/dz = q - p~ (c, Vd), recomputed from the saved normalisers (3, c)."""
    g = at_least_f32(F.linear(x, W)).sub_(norms[2][:, None]).exp_()  # (c, Vd) q
    if labels is None:
        pd = _teacher_p(teacher, src, ids, norms)[0]
        g.sub_(pd.div_(norms[1].exp()[:, None]))  # q - p~
    else:
        g[torch.arange(g.shape[0], device=g.device), labels] -= 1
    return g


def streaming_pass_losses(hs, norm, W, ids, teacher: Teacher, valid, labels, count, *, pass_weight: float,
                          cp: int, local_cu, chunk: int):
    """sum_d w_d * mean CE for passes d = 1..P; hs [h^1..h^P] (T, H); valid / labels per pass (T,); count (P,) global.
    Returns (loss, stats (P, 5) this rank's sums)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: expected >= 1 rows per chunk (0 selects the dense reference)")
    n, loss, stats = len(hs), 0.0, []
    agree_prev = torch.ones(hs[0].shape[0], dtype=torch.bool, device=hs[0].device)
    for d, h in enumerate(hs, 1):
        coef = (pass_weight ** (d - 1) / count[d - 1].clamp_min(1)).to(at_least_f32(h).dtype) \
            * valid[d - 1].to(at_least_f32(h).dtype)  # (T,)
        src = teacher_index(local_cu, d, n, cp)
        lab = None if labels is None else labels[d - 1]
        x = norm(h)
        wg = WeightGrad(W, x)  # dW into W's fp32 .main_grad under mixed precision
        l, s, agree_prev = StreamingSoftCE.apply(x, wg.weight(), coef, valid[d - 1], src, lab, ids, agree_prev,
                                                 teacher, chunk, wg)
        loss, _ = loss + l, stats.append(s)
    return loss, torch.stack(stats)


# ------------------------------------------------------------------------------------------------ the dense reference
def dense_pass_losses(hs, logits_fn, draft_ids, teacher_logits, valid, labels, count, *, pass_weight: float, shifted):
    """The dense reference (every (T, V) tensor materialised): what the tests hold the streamed loss to, and the
    dense row of bench/bench_draft_step.py (method "old"). shifted(x, d, fill) is the CP-aware shift; labels are draft
    ids (hard) or None; draft_ids (Vd,) the target id of each draft id. Returns what streaming_pass_losses returns."""
    T = hs[0].shape[0]
    logp = torch.log_softmax(at_least_f32(teacher_logits.detach()), -1)  # (T, V) the teacher at every position
    loss, stats, agree_prev = 0.0, [], torch.ones(T, dtype=torch.bool, device=hs[0].device)
    for d, (h, m) in enumerate(zip(hs, valid), 1):
        p_log = shifted(logp, d, 0.0)  # (T, V) teacher p_{i+d}
        q_log = torch.log_softmax(at_least_f32(logits_fn(h)), -1)  # (T, Vd)
        if labels is not None:
            ce = -q_log.gather(-1, labels[d - 1][:, None])[:, 0]
        else:  # soft CE against the teacher restricted (renormalised) to the draft vocabulary
            ce = -(torch.softmax(p_log[:, draft_ids], -1) * q_log).sum(-1)
        loss = loss + pass_weight ** (d - 1) * (ce * m).sum() / count[d - 1].clamp_min(1).to(ce.dtype)
        with torch.no_grad():  # acceptance metrics against the full teacher p, q placed in the target vocabulary
            p = p_log.exp()
            q = torch.zeros_like(p).index_copy_(-1, draft_ids, q_log.exp())
            agree = q.argmax(-1) == p.argmax(-1)
            mf = m.double()
            stats.append(torch.stack([(ce.double() * mf).sum(), (agree * mf).sum(), ((agree & agree_prev) * mf).sum(),
                                      (agree_prev * mf).sum(), (torch.minimum(p, q).sum(-1).double() * mf).sum()]))
            agree_prev = agree_prev & agree
    return loss, torch.stack(stats)


# ------------------------------------------------------------------------------------------------ pass targets, sums
def pass_targets(tokens, cu_seqlens, loss_mask, num_passes: int, ring, *, hard_labels: bool, t2d):
    """Per pass d, at each anchor row i: valid (T,) = loss_mask[i] & loss_mask[i+d] (loss_mask is per prediction,
    rl_loop.py's indexing: x_{i+1} was sampled by the policy, so a chain from i occurs at inference, and the
    prediction of x_{i+d+1} counts) and, with hard labels, the target id x_{i+d+1} (the draft must be able to name
    it: t2d). Returns (valid list, labels list or None, count (P,) global)."""
    shifted = lambda x, d, fill: cp_shift(x, cu_seqlens, d, group=ring, fill=fill)[0]  # noqa: E731
    m = loss_mask.bool()
    valid = [m & shifted(m, d, False) for d in range(1, num_passes + 1)]
    labels = [shifted(tokens, d + 1, 0) for d in range(1, num_passes + 1)] if hard_labels else None
    if hard_labels:
        valid = [m & t2d[y] for m, y in zip(valid, labels)]
    count = ring_sum(torch.stack([m.sum() for m in valid]).double(), ring)  # (P,) sync point under CP
    return valid, labels, count


def ring_sum(x, ring):
    """All-reduce (sum) of a small tensor over the CP ring: cp-1 hops, each rank adds what arrives and passes it on."""
    acc, cur = x.clone(), x
    for _ in range(ring.size - 1):
        nxt = torch.empty_like(x)
        ring.exchange([((ring.rank + 1) % ring.size, cur)], [((ring.rank - 1) % ring.size, nxt)], "ring_sum").wait()
        acc, cur = acc + nxt, nxt
    return acc
