"""Adaptive speculation length: the number of draft tokens k in {0, ..., K} chosen at every decode step of a chain
draft from costs and acceptance measured online (speculative.generate(adapt=AdaptiveK(K))). k = 0 is plain
autoregressive decoding.

The cost model. An engine call is batch-synchronous: it lasts until its slowest row is done. With r rows in the
batch, n of them still open and at most `left` new tokens to come in a row, the controller picks the k with which the
call would end soonest if it ran at that k to its end:

    k* = argmax_{k = 1..K} rate(k)   if rate^(k*) > (1 + margin) rate(0), else 0    (rate^: the optimistic alphas)
    rate(k)  = left / (c(r, k, L + left / 2) steps(k))                 the slowest row's tokens per second
    steps(k) = max((left + o_k) / mu_k + kappa e_n sqrt(sigma_k^2 left / mu_k^3 + (rho o_k left / mu_k)^2), 1)
                                                                                      (call_steps; k = 0: left)

    X           = min(kept | k, left): the tokens a row keeps from one step, P(X >= j) = prod_{i<j} alpha_i for
                  j = 1..min(k + 1, left); mu_k = E[X] = E[kept | k] when left > k, sigma_k^2 its variance
                  (kept_moments); a row's steps to `left` tokens are about normal with mean (left + o_k) / mu_k,
                  o_k = (E[X^2] - mu_k) / (2 mu_k) the last step's overshoot, and variance left sigma_k^2 / mu_k^3
                  (renewal theory)
    e_n         = E[max of n standard normals] (e_1 = 0, e_8 = 1.42, e_64 = 2.34): the slowest of the n open rows
    rho         = the rows' relative spread in acceptance (a row's drafts accepted at (1 + rho z) alpha_j), measured
                  from each call's per-row drafts tried / accepted (row_spread, AdaptiveK.end), pooled with decay: a
                  row's rate moves by mu_k o_k per unit of ln alpha, so its steps spread by left rho o_k / mu_k more
    alpha_j     = P(d_j accepted | d_<j accepted)               per position, measured online with decay:
                = (A_j + m alpha~_j) / (R_j + m)                A_j / R_j drafts accepted / tried at position j, each
                                                                step's counts down-weighted by exp(-n / accept_memory)
                                                                once n more rows have tried a draft since; m = 4 pseudo-
                                                                counts towards alpha~_1 = 1/2, alpha~_j = alpha_{j-1}
                                                                (a position tried rarely leans on the one before it);
                                                                switching off takes each at its optimistic bound
                                                                alpha_j + z sqrt(alpha_j (1 - alpha_j) / (R_j + 1))
                                                                (z = `confidence`, 2)
    c(r, k, L)  = seconds of a step at k with r rows (open or riding along) and context L (the longest row's cached
                  positions), the costs taken at the mean context of the rest of the call

A step at k is timed whole, from the end of the step before (the draft's k - 1 passes, k samples and trunk extend,
one policy forward over S = k + 1 tokens per row, the accept rule, the commit, the engine's poll and compaction and
the controller's own bookkeeping); a call's first step, from its choice.

Why the slowest row: an autoregressive call takes exactly `left` steps, every row in step; a speculative row keeps
1..k+1 tokens a step, so rows drift apart and the call waits for the last. The per-step rate E[kept | k] / c(r, k)
leaves that out, and it is what makes speculation lose at large batch. The term grows with n (none at batch 1) and
with k (a larger k keeps a more variable number of tokens, and its rate depends more on the row's acceptance). What
the model still misses leans towards speculation, so each call measures its own slowest row: kappa, the rows' max -
mean forwards over e_n x the model's sd (straggle_ratio: among the rows that took the whole budget, the sd averaged
over the call's k), pooled over calls with decay from a prior of 1 (64 pseudo-rows); rows that are alike, as the model
assumes, give ~1. Near a call's end X is capped by `left`: the drafts past the last token a row may take are wasted,
so k falls there. (docs/benchmarks.md, "Adaptive k", holds the model against measured calls, with the commands.)

Why m = 4 pseudo-counts: a position tried rarely leans on the one before it rather than on a few coin flips; else an
estimate from a handful of tries that comes out low stops the position from being tried again once k falls below it.

A step costs more as its context grows (attention reads L keys per token), and the ks run at different points of a
call (probes at its start, k = 0 often late), so each k's timings are first moved to the present context along a
slope in L that is a line in S, fitted within each k:

    t_k(L)  = t_k + g_k (L - L_k),  g_k = max(g0 + g1 S_k, 0)
                                          t_k, L_k: each k's mean time and context, weighted by exp(-age / cost_memory)
                                          (age in steps) and by a kernel in the batch size, exp(-(ln r_i - ln r)^2 /
                                          (2 h^2)); (g0, g1) the least-squares fit to the steps' times centred within
                                          each k (a common slope g0 where S does not vary)
    a + b S                               the least-squares line (b >= 0) through the moved means t_k(L), weight W_k

(The slope is fitted rather than taken proportional to S: a step's growth with context is far from proportional to
S, and a slope in S L overcharges large k late in a call.) So the steps run at r's size count most and nothing is
keyed by batch size or temperature. The line is the prior of each k's own timings: with n_k steps timed at k
(kernel-weighted counts),

    c(r, k, L) = (n_k t_k(L) + m_c (a + b (k + 1))) / (n_k + m_c),   m_c = 2 pseudo-steps

so a k run often is costed by what it took and a k rarely or never run by the line. (A step is not affine in S: its
fixed part dominates at small S, and a line through the k run most misprices the others.)
A `costs(rows, k) -> (draft s, verify s)` source replaces the clock (tests, simulations). The first steps, and the
first at a batch size more than 2x away from every timed one, are probes: k = K, 0, 1, twice, so S and k both vary
before the fit is used.

k* is decided afresh every `decide_every` (4) steps while it is > 0, at every step near a call's end (left <= 2 (K + 1))
or at k* = 0 (best() is Python over every k's rate: cheap, but not worth running at every step).

While k* > 0, every `explore_every` steps runs at k* + 1, k* - 1 or 0 in turn (inside 0..K), so the k next to the
choice and the k it is weighed against stay timed at the batch size running (else k = 0 would be timed only at a
call's end, with the few rows still open).

The machine's pace moves all k alike, and only the k that run see it: a slow spell while k = 3 runs would leave k = 3
dear next to a k = 0 timed before it, and switch speculation off on a clock artefact. So each step is stored at a
common pace,

    t_stored = t / P,   ln P += clip(ln t - ln P - lbar, +-0.5) / pace_memory      (pace_memory = 16 steps)
                        ln P *= 1 - 1 / pace_anchor                               (pace_anchor = 256 steps)

lbar the stored mean of ln t_stored in the step's own cell (batch size, context bucket, k; once it holds 4 steps; a
call's first step, not timed whole, does not move P). The mean of the logs, not the log of the mean: for noisy steps the
latter sits ~sd^2 / 2 higher, so every step would push ln P down. And the pull back to P = 1: P and the cells' means
can trade places along a line (a higher P, lower stored times), so the estimate is a random walk, and a k not run
since an earlier P would be mis-costed against the k run now by the whole drift. The choice is unchanged by P (every
rate scales by 1 / P); what changes is that a spell's timings are stored at the common pace, so afterwards the k not
run since are not cheaper than the k run through it (tests/test_adaptive_k.py: a 1.5x spell, every k within 5% of its
true cost afterwards).

k = 0 runs no draft pass. Inside a run of speculation (probes, exploring, k* = 1's neighbour) the policy's taps of a
k = 0 step wait in the draft's trunk (decoding/draft_trunk.py), which extends over them in one forward at the next
step with k > 0; that catch-up is the price of switching back on and is charged to that step. Once k* = 0 at
`settle` (3) steps running, each one run at k = 0 and so timed afresh at the present context, the rest of the call is
autoregressive (`dormant`: k() releases the draft, so no taps are kept and no catch-up runs): keeping the draft ready
would cost a trunk forward per token. A call that starts at k* = 0 is dormant from its start (begin() returns False:
no draft prefill either), unless `explore_off` (512) steps ran at k = 0 since speculation last ran: then its first
step runs the best k > 0 instead (the argmax the margin turned down), so acceptance and that k's cost are observed now
and then (while k = 0 nothing is observed and nothing decays) and speculation comes back when the draft does.
Exploring is dear beyond its own step: the draft's prefill, and rows that then differ in length for the rest of the
call, so every later step attends through a padding mask; hence not more often.

Switching off needs evidence: the optimistic alphas (at batch 1 the probes try only a few drafts) and `settle`
decisions running. The margin (default 5%) is for what the model leaves out, all of it a cost of speculation: the
draft's prefill, the catch-up after k = 0 steps, the finished rows that ride along until a quarter of the batch is done
(speculative.compact); a tie goes to k = 0.

Lossless at every k: each step is an exact speculative-sampling step whatever k is, and k depends only on the past.
But the sampled tokens then depend on the clock (a run is not reproducible from its seed), so the adaptive k is
opt-in (--num_draft_tokens=auto); k_control.KSchedule (a fixed cycle of k, no clock) is how the tests switch k
mid-generation. On a GPU pass a clock that synchronizes the device (for_device) or the timings see only the kernel
launches.

    step_costs_naive(obs, r, ...)   the cost fit written out on a plain list (the reference); E[kept | k]
    (kept_moments), the slowest row's steps and the rows' spread: decoding/call_model.py

Letters: K the ceiling, r rows in the batch, S tokens per row in one verification forward (k + 1), H hidden.
"""
from __future__ import annotations

import functools
import math
import time

import torch

from decoding.call_model import call_steps, kept_moments, row_spread, straggle_ratio


@functools.lru_cache(maxsize=4096)
def _kernel(r_i: float, r: float, h: float) -> float:
    return math.exp(-(math.log(r_i) - math.log(r)) ** 2 / (2 * h * h))


def _bucket(ctx):
    """A step's context length (the longest row's cached positions) -> its bucket, 4 per doubling; None: not given."""
    return None if ctx is None else round(4 * math.log2(max(ctx, 1)))


def _centre(b) -> float:  # a bucket's context length; None (not given) counts as 0
    return 0.0 if b is None else 2.0 ** (b / 4)


def _solve_affine(w, ws, wss, wt, wst):
    """Weighted least squares t = a + b S from the sums of w, w S, w S^2, w t, w S t; b >= 0 (more tokens never
    cost less), b = 0 when S did not vary; a >= 0 (no step is free: where the line would cross 0 above S = 0, the
    least-squares line through the origin)."""
    if w <= 0:
        return None
    ms, mt = ws / w, wt / w
    var = wss / w - ms * ms
    b = max((wst / w - ms * mt) / var, 0.0) if var > 1e-12 else 0.0
    return (mt - b * ms, b) if mt - b * ms >= 0 else (0.0, max(wst / wss, 0.0))


def _slopes(per_k: dict) -> dict:
    """Each k's slope of t in the context L, g_k = max(g0 + g1 S_k, 0): the line in S fitted by least squares to the
    within-k centred sums pooled over the k's (one common slope g0 where S does not vary among the k's that vary in
    L)."""
    c = {k: (XX - X * X / W, XT - X * T / W) for k, (W, T, X, XX, XT, n) in per_k.items() if W > 0}
    tiny = 1e-9 * sum(v[3] for v in per_k.values()) + 1e-12  # below: rounding of a context that did not vary
    a11, a12, a22 = (sum(sxx * (k + 1.0) ** p for k, (sxx, _) in c.items()) for p in (0, 1, 2))
    b1, b2 = (sum(sxt * (k + 1.0) ** p for k, (_, sxt) in c.items()) for p in (0, 1))
    det = a11 * a22 - a12 * a12
    if a11 > tiny and det > 1e-6 * a11 * a22 > 0:
        g0, g1 = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    else:
        g0, g1 = (b1 / a11 if a11 > tiny else 0.0), 0.0
    return {k: max(g0 + g1 * (k + 1), 0.0) for k in c}


def _combine(per_k: dict, K: int, ctx, m: float) -> list:
    """c(k) for k = 0..K from per-k weighted sums [W, T, X, XX, XT, n] (weights w, times t, x = L the context): each
    k's mean moved to x = ctx along its slope (_slopes), shrunk towards the affine fit a + b S of the moved times by m
    pseudo-steps (module docstring)."""
    g = _slopes(per_k)
    if ctx is None:  # no context asked: the weighted mean one
        ctx = sum(v[2] for v in per_k.values()) / max(sum(v[0] for v in per_k.values()), 1e-300)
    moved = {k: max(T + g[k] * (ctx * W - X), 0.5 * T) / W  # a noisy slope never takes a k below half its mean
             for k, (W, T, X, XX, XT, n) in per_k.items() if W > 0}
    sums = [0.0] * 5
    for k, t in moved.items():
        W, S = per_k[k][0], k + 1.0
        for i, v in enumerate((W, W * S, W * S * S, W * t, W * S * t)):
            sums[i] += v
    a, b = _solve_affine(*sums) or (0.0, 0.0)
    out = []
    for k in range(K + 1):
        prior, n = a + b * (k + 1), per_k[k][5] if k in per_k else 0.0
        out.append((n * moved[k] + m * prior) / (n + m) if k in moved else prior)
    return out


def step_costs_naive(obs, r: float, K: int, memory: float, h: float, m: float = 2.0, ctx=None) -> list:
    """The reference for AdaptiveK.costs_at: obs [(rows, k, draft s, verify s, context length or None)] oldest first ->
    c(r, k) at context ctx for k = 0..K, the sums written out (weights exp(-age / memory) * kernel(rows, r), counts
    kernel(rows, r); a step's context at its bucket's centre)."""
    per_k = {}
    for age, (r_i, k, td, tv, L) in enumerate(reversed(obs)):
        kern = _kernel(r_i, r, h)
        w, x, t = math.exp(-age / memory) * kern, _centre(_bucket(L)), td + tv
        e = per_k.setdefault(k, [0.0] * 6)
        for i, v in enumerate((w, w * t, w * x, w * x * x, w * x * t, kern)):
            e[i] += v
    return _combine(per_k, K, ctx, m)


class AdaptiveK:
    """The controller: choose(rows) -> k before a step, record(...) after it; k(s) / observe(s) are the same for the
    engine (k_control.py). One instance lives across engine calls (its measurements carry over); begin(K) starts a
    call."""

    def __init__(self, max_k: int, *, clock=time.perf_counter, costs=None, accept_memory: float = 1000.0,
                 cost_memory: float = 64.0, bandwidth: float = 0.2, explore_every: int = 32, probe_rounds: int = 2,
                 margin: float = 0.05, confidence: float = 2.0, settle: int = 3, pace_memory: float = 16.0,
                 decide_every: int = 4, explore_off: int = 512,
                 pace_anchor: float = 256.0):
        if not (isinstance(max_k, int) and max_k >= 1):
            raise ValueError(f"max_k={max_k!r}: expected an int >= 1 (the ceiling K of the adaptive k)")
        self.max_k, self.clock, self.costs = max_k, clock, costs
        self.accept_memory, self.cost_memory, self.h, self.margin = accept_memory, cost_memory, bandwidth, margin
        self.z = confidence  # k = 0 only where even alpha_j + z sd_j would not pay for speculation
        self.explore_every, self.probes = explore_every, (max_k, 0, 1) * probe_rounds
        self.R, self.A = [0.0] * max_k, [0.0] * max_k  # decayed drafts tried / accepted per position
        self.timed = {}  # (rows, context bucket) -> {k: [w, w t, n, w ln t]}: the steps timed there at k (whole);
        self.age = 0  # w = exp(step / cost_memory) (rescaled now and then): the decay without touching old entries
        self.pace, self.pace_memory, self.pace_anchor = 0.0, pace_memory, pace_anchor  # ln of the machine's pace
        self.decide_every, self.held, self.k_star, self.held_rows = decide_every, 0, 0, None  # _decide
        self.queue, self.since, self.up, self.seen, self.mark, self.mark_first = [], 0, 0, None, None, None
        self.dormant, self.first = False, True  # off for the rest of the call; the call's first step
        self.settle, self.zeros, self.k_spec = settle, 0, 1  # k* = 0 this many times running: off; the best k > 0
        self.explore_off, self.off_steps = explore_off, 0  # at k* = 0: a call explores after this many steps at 0
        self.chosen = [0] * (max_k + 1)  # steps run at each k (reporting)
        self.spread, self.straggle = [0.0, 0.0], [0.0, 0.0]  # decayed sums of rows x (rho^2, kappa) and of rows
        self.at_begin = list(self.chosen)  # steps at each k when the call began

    @classmethod
    def for_device(cls, max_k: int, device, **kw) -> "AdaptiveK":
        """A controller whose clock waits for the device's queued work (CUDA), else time.perf_counter."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return cls(max_k, **kw)
        return cls(max_k, clock=lambda: (torch.cuda.synchronize(dev), time.perf_counter())[1], **kw)

    # -- the engine's hooks -----------------------------------------------------------------------------------------
    def begin(self, K: int, rows: int = None, ctx: int = None, left: int = None) -> bool:
        """A call starts: K its ceiling, rows its batch, ctx its longest prompt, left its max_new_tokens. Where k* = 0
        there and fewer than explore_off steps ran at k = 0 since speculation last ran, the whole call is dormant:
        returns False (no draft prefill)."""
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the controller's ceiling K={self.max_k}")
        self.seen, self.mark = None, None  # the call's cumulative per-position counts start at 0; no step ended yet
        self.queue, self.at_begin = [], list(self.chosen)  # probes left from a batch size of the last call: dropped
        self.first, self.zeros, self.held = True, 0, 0
        self.dormant = (rows is not None and not self.queue and self._near(rows) and self.off_steps < self.explore_off
                        and self.best(rows, ctx, left, rows) == 0)
        return not self.dormant

    def k(self, s) -> int:
        """k_control.py: choose() from the engine's state; once dormant, the draft is released for the call."""
        k = self.choose(s.live.numel(), s.pcache.bound, left=s.left, open_rows=s.open)  # host ints (speculative.poll)
        if self.dormant:
            s.trunk.release()
        return k

    def observe(self, s):
        """k_control.py: record() the step the engine just ran."""
        self.record(s.live.numel(), s.k, s.counts.reached, s.counts.accepted, ctx=s.pcache.bound)

    def choose(self, rows: int, ctx: int = None, left: int = None, open_rows: int = None) -> int:
        """k for the next step at `rows` batch rows (open_rows of them not finished), context length ctx, and at most
        `left` new tokens still to come in a row (None: the per-step model). Sets `dormant` once k* = 0 after a call's
        first step: k = 0 for the rest of the call (k() then releases the draft: no taps kept, no catch-up)."""
        if self.mark is None and self.costs is None:  # a call's first step is timed from here (no step ended before)
            self.mark_first = self.clock()
        if self.dormant:
            self.chosen[0], self.off_steps = self.chosen[0] + 1, self.off_steps + 1
            return 0
        if not self.queue and not self._near(rows):
            self.queue = list(self.probes)
        if self.queue:
            k = self.queue.pop(0)
        else:
            k, self.since = self._decide(rows, ctx, left, open_rows), self.since + 1
            if k == 0:  # the call's first step explores the best k > 0 (acceptance and cost); then off as below
                self.zeros += 0 if self.first else 1  # k* = 0 `settle` times running: off for the rest of the call
                k, self.dormant = (self.k_spec, False) if self.first else (0, self.zeros >= self.settle)
            else:
                self.zeros = 0
                if self.since >= self.explore_every:  # a neighbour of k*, or k = 0: its timings refresh
                    self.since, self.up = 0, (self.up + 1) % 3
                    k = (k + 1 if k < self.max_k else k - 1) if self.up == 1 else k - 1 if self.up == 2 else 0
        self.first = False
        self.chosen[k] += 1
        self.off_steps = self.off_steps + 1 if k == 0 else 0
        return k

    def record(self, rows: int, k: int, reached, accepted, ctx: int = None):
        """After a step: the call's cumulative per-position counts (K,) and the context length it ran at (None: not
        given; every step then counts alike). Its seconds: costs(rows, k), or the clock's, a step after the call's
        first timed whole from the end of the step before (the engine's poll and compact, choose and record
        included), the first from its choose()."""
        R, A = reached.tolist(), accepted.tolist()  # host sync: K numbers
        prev = self.seen or ([0] * len(R), [0] * len(A))
        dR, dA = [x - y for x, y in zip(R, prev[0])], [x - y for x, y in zip(A, prev[1])]
        self.seen = (R, A)
        if dR and dR[0] > 0:
            d = math.exp(-dR[0] / self.accept_memory)
            for j in range(min(len(dR), self.max_k)):
                self.R[j], self.A[j] = d * self.R[j] + dR[j], d * self.A[j] + dA[j]
        now = self.clock() if self.costs is None else None
        whole = now is None or self.mark is not None  # timed whole (a call's first step is not: no step before it)
        t = sum(self.costs(rows, k)) if now is None else now - (self.mark if whole else self.mark_first)
        self.mark = now
        self.age += 1
        if self.age > 200 * self.cost_memory:  # rescale before exp() overflows; drop what has decayed away
            f = math.exp(-self.age / self.cost_memory)
            for by_k in self.timed.values():
                for e in by_k.values():
                    e[0], e[1], e[3] = e[0] * f, e[1] * f, e[3] * f
            self.timed = {r: {k_: e for k_, e in by_k.items() if e[0] > 1e-12} for r, by_k in self.timed.items()}
            self.timed = {r: by_k for r, by_k in self.timed.items() if by_k}
            self.age = 0
        w = math.exp(self.age / self.cost_memory)
        e = self.timed.setdefault((rows, _bucket(ctx)), {}).setdefault(k, [0.0, 0.0, 0.0, 0.0])
        t = max(t, 1e-9)
        self.pace *= 1.0 - 1.0 / self.pace_anchor  # pulled back to 1: its estimate is a random walk otherwise
        if whole and e[2] >= 4:  # the machine's pace now: this step's log time against its cell's (normalised) mean
            r = math.log(t) - self.pace - e[3] / e[0]
            self.pace += max(min(r, 0.5), -0.5) / self.pace_memory  # an outlier moves it by 3% at most
        t = t / math.exp(self.pace)  # stored at the common pace: a slow spell moves every k's costs alike
        e[0], e[1], e[2], e[3] = e[0] + w, e[1] + w * t, e[2] + 1.0, e[3] + w * math.log(t)

    def end(self, rollout):
        """A call ended: the rows' spread in acceptance from its per-row counts (row_spread), rho^2 pooled over calls
        with decay (each call's weight: its rows; older calls' sums x exp(-rows / accept_memory)). Returns the
        rollout."""
        st = rollout.stats
        rho2, n = row_spread(st.row_tried, st.row_accepted, self.alphas())
        if n:
            d = math.exp(-n / self.accept_memory)
            self.spread = [d * self.spread[0] + n * rho2, d * self.spread[1] + n]
        ratio, n = straggle_ratio(st.row_forwards, st.row_kept, [a - b for a, b in zip(self.chosen, self.at_begin)],
                                  self.alphas(), self.rho())
        if n:
            d = math.exp(-n / self.accept_memory)
            self.straggle = [d * self.straggle[0] + n * ratio, d * self.straggle[1] + n]
        return rollout

    def kappa(self) -> float:
        """The slowest row's distance above the mean row, measured over the model's (straggle_ratio), pooled over
        calls with decay towards 1 by 64 pseudo-rows (one batch-64 call)."""
        return (self.straggle[0] + 64.0) / (self.straggle[1] + 64.0)

    def rho(self) -> float:
        """The rows' relative spread in acceptance: sqrt of the pooled rho^2, clipped at 0 (0 until a call measured
        it)."""
        return math.sqrt(max(self.spread[0] / self.spread[1], 0.0)) if self.spread[1] > 0 else 0.0

    def _decide(self, rows: int, ctx, left, open_rows) -> int:
        """k* = best(...), or the last k* > 0 again for up to decide_every - 1 steps at the same batch size while more
        than 2 (K + 1) tokens are left (k* moves slowly, and best() is not free)."""
        near_end = left is not None and left <= 2 * (self.max_k + 1)
        if self.held > 0 and self.k_star > 0 and rows == self.held_rows and not near_end:
            self.held -= 1
            return self.k_star
        self.k_star, self.held_rows, self.held = self.best(rows, ctx, left, open_rows), rows, self.decide_every - 1
        return self.k_star

    # -- the model --------------------------------------------------------------------------------------------------
    def alphas(self) -> list:
        out, prior = [], 0.5
        for R, A in zip(self.R, self.A):
            prior = (A + 4.0 * prior) / (R + 4.0)  # m = 4 pseudo-counts towards the position before
            out.append(prior)
        return out

    def costs_at(self, rows: int, ctx: int = None) -> list:
        """c(r, k) for k = 0..K at r = rows and context length ctx (seconds per step), from the timed steps (module
        docstring)."""
        per_k = {}
        for (r, lb), by_k in self.timed.items():
            c, L = _kernel(r, rows, self.h), _centre(lb)
            for k, (w, wt, n, _) in by_k.items():
                x, cw, ct = L, c * w, c * wt
                e = per_k.setdefault(k, [0.0] * 6)
                e[0], e[1], e[2], e[3], e[4], e[5] = e[0] + cw, e[1] + ct, e[2] + cw * x, e[3] + cw * x * x, \
                    e[4] + ct * x, e[5] + c * n
        return _combine(per_k, self.max_k, ctx, 2.0)

    @staticmethod
    def _rates(al, costs, left, n, rho=0.0, kappa=1.0) -> list:
        """Tokens per second per row, k = 0..K: E[kept | k] / c(r, k) per step (left None), or over the rest of the
        call, left / (c(r, k) steps(k)) (module docstring)."""
        if left is None:
            return [kept_moments(al, k)[0] / max(c, 1e-12) for k, c in enumerate(costs)]
        return [left / max(c * call_steps(al, k, left, max(n, 1), rho, kappa), 1e-12) for k, c in enumerate(costs)]

    def best(self, rows: int, ctx: int = None, left: int = None, open_rows: int = None) -> int:
        """k* = argmax rate over k >= 1, or 0 where k* does not beat k = 0 by the factor 1 + margin even at the
        optimistic acceptance (module docstring)."""
        costs = self.costs_at(rows, ctx if left is None or ctx is None else ctx + left / 2)  # the rest's mean context
        al, n, rho, kappa = self.alphas(), open_rows or rows, self.rho(), self.kappa()
        rates = self._rates(al, costs, left, n, rho, kappa)
        k = self.k_spec = max(range(1, self.max_k + 1), key=lambda j: rates[j])  # the best k > 0 (explored when off)
        hi = [min(a + self.z * math.sqrt(a * (1 - a) / (R + 1.0)), 1.0) for a, R in zip(al, self.R)]
        return k if self._rates(hi, costs, left, n, rho, kappa)[k] > (1.0 + self.margin) * rates[0] else 0

    def summary(self) -> dict:
        """What the controller believes and did: alpha_j, the steps it ran at each k, the k it ran most."""
        return dict(alpha=[round(a, 3) for a in self.alphas()], steps_at_k=list(self.chosen),
                    k_mode=max(range(self.max_k + 1), key=lambda k: self.chosen[k]),
                    k_mean=round(sum(k * n for k, n in enumerate(self.chosen)) / max(sum(self.chosen), 1), 2))

    def _near(self, rows: int) -> bool:  # a timed batch size within 2x
        return any(abs(math.log(r / rows)) <= math.log(2) for r, _ in self.timed)

