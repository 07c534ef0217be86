"""Adaptive speculation length: the number of draft tokens k in {0, ..., K} chosen at every decode step of a chain
draft from costs and acceptance measured online (speculative.generate(adapt=AdaptiveK(K))). k = 0 is plain
autoregressive decoding.

The cost model. With r rows in the batch, one step at k keeps E[kept | k] tokens per row and takes c(r, k) seconds;
the controller picks the k with the most tokens per second:

    k* = argmax_{k = 1..K} E[kept | k] / c(r, k)   if that rate exceeds (1 + margin) / c(r, 0), else 0

    E[kept | k] = 1 + sum_{i=1..k} prod_{j=1..i} alpha_j        the accepted drafts and the token after them
    alpha_j     = P(d_j accepted | d_<j accepted)               per position, measured online with decay:
                = (A_j + m alpha~_j) / (R_j + m)                A_j / R_j drafts accepted / tried at position j, each
                                                                step's counts down-weighted by exp(-n / accept_memory)
                                                                once n more rows have tried a draft since; m = 1 pseudo-
                                                                count towards alpha~_1 = 1/2, alpha~_j = alpha_{j-1}
                                                                (a position never tried borrows the one before it)
    c(r, k)     = c_verify(r, k + 1) + k c_draft(r)
    c_verify(r, S) = a(r) + b(r) S    one policy forward over S tokens per row, the accept rule, the commit and every
                                      fixed cost of a step: all of the step but the draft
    c_draft(r)                        the draft's seconds per draft token (its k - 1 passes, k samples, the trunk's
                                      extend over the k + 1 verified positions)

a(r), b(r) >= 0 and c_draft(r) are least-squares fits over the timed steps, each weighted by exp(-age / cost_memory)
(age in steps) and by a kernel in the batch size, exp(-(ln r_i - ln r)^2 / (2 h^2)), so the steps run at r's size count
most and nothing is keyed by batch size or temperature. The fit is the prior of each k's own timings: with n_k steps
timed at k (kernel-weighted counts) and their mean t_k (weighted the same way),

    c(r, k) = (n_k t_k + m_c (c_verify(r, k + 1) + k c_draft(r))) / (n_k + m_c),   m_c = 2 pseudo-steps

so a k run often is costed by what it took and a k rarely or never run by the fit. (A step is not affine in S: with
bench/bench_rollout.py's policy at batch 64, tau 1.5, one CPU thread on a shared 2-core VM, the median verify part took
7.7 / 13.9 / 18.3 / 26.2 ms at S = 1 / 2 / 3 / 7, and a line through the k run most overcharged k = 0 by ~40%.)
Timings are the clock's, taken around the draft's work and around the rest of the step (speculative.chain_step); a
`costs(rows, k) -> (draft s, verify s)` source replaces them (tests, simulations). The first steps, and the first at a
batch size more than 2x away from every timed one, are probes: k = K, 0, 1, twice, so S and k both vary before the fit
is used.

While k* > 0, every `explore_every` steps one step runs at a neighbour of k* instead (k* + 1 and k* - 1 in turn,
inside 0..K), so the timings of the k next to the choice stay fresh (a k left alone keeps its old mean).

k = 0 runs no draft pass. Inside a run of speculation (probes, exploring, k* = 1's neighbour) the policy's taps of a
k = 0 step wait in a Backlog, and the draft's trunk extends over them in one forward at the next step with k > 0; that
catch-up is the price of switching back on and is charged to that step's draft seconds. Once k* = 0 the rest of the
call is autoregressive (`dormant`: no taps kept, no catch-up, the draft idle): keeping the draft ready costs a trunk
forward per token (bench/bench_rollout.py's pair at batch 64, one CPU thread: a catch-up over 32 steps took ~26 ms
beside ~12 ms per autoregressive step, i.e. ~7%). A call whose first step finds k* = 0 runs that one step at k = 1
instead, so acceptance and the k = 1 cost are observed once per call (while k = 0 nothing is observed and nothing
decays) and speculation comes back when the draft does.

The margin (default 5%) is for what the model leaves out, all of it a cost of speculation: the end of a call (rows
reach max_new_tokens at different steps and finished rows ride along until a quarter of the batch is done,
speculative.compact, where autoregressive rows all finish together) and the catch-up after k = 0 steps. Where k = 0
and speculation tie per step (batch 64, tau 1.5 in the benchmark, where every fixed k loses to autoregressive
decoding end to end) the tie goes to k = 0.

Lossless at every k: each step is an exact speculative-sampling step whatever k is, and k depends only on the past.
But the sampled tokens then depend on the clock (a run is not reproducible from its seed), so the adaptive k is
opt-in (--num_draft_tokens=auto); KSchedule (a fixed cycle of k, no clock) is how the tests switch k mid-generation.
On a GPU pass a clock that synchronizes the device (for_device) or the timings see only the kernel launches.

    expected_kept(alphas, k), step_costs_naive(obs, r, ...)   the formulas above on plain lists (the references)

Letters: K the ceiling, r rows in the batch, S tokens per row in one verification forward (k + 1), H hidden.
"""
from __future__ import annotations

import math
import time

import torch


def expected_kept(alphas, k: int) -> float:
    """E[kept | k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j: tokens a row keeps from one verification forward."""
    e, p = 1.0, 1.0
    for a in alphas[:k]:
        p *= a
        e += p
    return e


def _kernel(r_i: float, r: float, h: float) -> float:
    return math.exp(-(math.log(r_i) - math.log(r)) ** 2 / (2 * h * h))


def _bucket(ctx):
    """A step's context length (the longest row's cached positions) -> its bucket, 4 per doubling; None: not given."""
    return None if ctx is None else round(4 * math.log2(max(ctx, 1)))


def _ctx_kernel(b_i, ctx, h: float) -> float:
    """The kernel in ln(context length) between bucket b_i (centre 2^(b_i / 4)) and `ctx`; 1 where either is None."""
    if b_i is None or ctx is None:
        return 1.0
    return math.exp(-(b_i / 4 * math.log(2) - math.log(max(ctx, 1))) ** 2 / (2 * h * h))


def _solve_affine(w, ws, wss, wt, wst):
    """Weighted least squares t = a + b S from the sums of w, w S, w S^2, w t, w S t; b >= 0 (more tokens never
    cost less), b = 0 when S did not vary."""
    if w <= 0:
        return None
    ms, mt = ws / w, wt / w
    var = wss / w - ms * ms
    b = max((wst / w - ms * mt) / var, 0.0) if var > 1e-12 else 0.0
    return mt - b * ms, b


def step_costs_naive(obs, r: float, K: int, memory: float, h: float, m: float = 2.0, ctx=None) -> list:
    """The reference for AdaptiveK.costs_at: obs [(rows, k, draft s, verify s, context length or None)] oldest first ->
    c(r, k) at context ctx for k = 0..K, the sums written out (weights exp(-age / memory) * kernel, counts kernel;
    kernel = kernel(rows, r) * kernel(context bucket, ctx))."""
    sums, per_k = [0.0] * 5, {}
    dw = dt = 0.0
    for age, (r_i, k, td, tv, L) in enumerate(reversed(obs)):
        kern = _kernel(r_i, r, h) * _ctx_kernel(_bucket(L), ctx, h)
        w, S = math.exp(-age / memory) * kern, k + 1.0
        for i, v in enumerate((w, w * S, w * S * S, w * tv, w * S * tv)):
            sums[i] += v
        dw, dt = dw + w * k, dt + w * td
        e = per_k.setdefault(k, [0.0, 0.0, 0.0])
        e[0], e[1], e[2] = e[0] + w, e[1] + w * (td + tv), e[2] + kern
    a, b = _solve_affine(*sums)
    cd = dt / dw if dw > 0 else 0.0
    out = []
    for k in range(K + 1):
        prior = a + b * (k + 1) + k * cd
        w, wt, n = per_k.get(k, (0.0, 0.0, 0.0))
        out.append((n * wt / w + m * prior) / (n + m) if w > 0 else prior)
    return out


class AdaptiveK:
    """The controller: choose(rows) -> k before a step, record(...) after it. One instance lives across engine calls
    (its measurements carry over); begin(K) starts a call."""

    def __init__(self, max_k: int, *, clock=time.perf_counter, costs=None, accept_memory: float = 1000.0,
                 cost_memory: float = 64.0, bandwidth: float = 0.35, explore_every: int = 32, probe_rounds: int = 2,
                 margin: float = 0.05):
        if not (isinstance(max_k, int) and max_k >= 1):
            raise ValueError(f"max_k={max_k!r}: expected an int >= 1 (the ceiling K of the adaptive k)")
        self.max_k, self.clock, self.costs = max_k, clock, costs
        self.accept_memory, self.cost_memory, self.h, self.margin = accept_memory, cost_memory, bandwidth, margin
        self.explore_every, self.probes = explore_every, (max_k, 0, 1) * probe_rounds
        self.R, self.A = [0.0] * max_k, [0.0] * max_k  # decayed drafts tried / accepted per position
        self.timed = {}  # rows -> {k: [w, w t_verify, w t_draft, n]}: the steps timed at that batch size and k;
        self.age = 0  # w = exp(step / cost_memory) (rescaled now and then): the decay without touching old entries
        self.queue, self.since, self.up, self.seen = [], 0, True, None
        self.dormant, self.first = False, True  # off for the rest of the call; the call's first step
        self.explore_off, self.off_steps = 4 * explore_every, 0  # at k* = 0: a call explores after this many steps
        self.chosen = [0] * (max_k + 1)  # steps run at each k (reporting)

    @classmethod
    def for_device(cls, max_k: int, device, **kw) -> "AdaptiveK":
        """A controller whose clock waits for the device's queued work (CUDA), else time.perf_counter."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return cls(max_k, **kw)
        return cls(max_k, clock=lambda: (torch.cuda.synchronize(dev), time.perf_counter())[1], **kw)

    # -- the engine's hooks -----------------------------------------------------------------------------------------
    def begin(self, K: int, rows: int = None, ctx: int = None):
        """A call starts: K its ceiling, rows its batch, ctx its longest prompt. Where k* = 0 there and fewer than
        explore_off steps ran at k = 0 since speculation last ran, the whole call is dormant (no draft prefill)."""
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the controller's ceiling K={self.max_k}")
        self.seen = None  # the call's cumulative per-position counts start at 0
        self.first = True
        self.dormant = (rows is not None and not self.queue and self._near(rows) and self.off_steps < self.explore_off
                        and self.best(rows, ctx) == 0)

    def choose(self, rows: int, ctx: int = None) -> int:
        """k for the next step at `rows` batch rows and context length ctx. Sets `dormant` once k* = 0 after a call's
        first step: k = 0 for the rest of the call, and the engine may drop the draft (no taps kept, no catch-up)."""
        if self.dormant:
            self.chosen[0], self.off_steps = self.chosen[0] + 1, self.off_steps + 1
            return 0
        if not self.queue and not self._near(rows):
            self.queue = list(self.probes)
        if self.queue:
            k = self.queue.pop(0)
        else:
            k, self.since = self.best(rows, ctx), self.since + 1
            if k == 0:  # the call's first step explores k = 1 (acceptance and cost); after it, off until the call ends
                k, self.dormant = (1, False) if self.first else (0, True)
            elif self.since >= self.explore_every:  # a neighbour of k*: its timings refresh
                self.since, self.up = 0, not self.up
                k = k + 1 if self.up and k < self.max_k else k - 1
        self.first = False
        self.chosen[k] += 1
        self.off_steps = self.off_steps + 1 if k == 0 else 0
        return k

    def record(self, rows: int, k: int, t_draft: float, t_verify: float, reached, accepted, ctx: int = None):
        """After a step: its seconds drafting / verifying, the call's cumulative per-position counts (K,), and the
        context length it ran at (None: not given; every step then counts alike)."""
        if self.costs is not None:
            t_draft, t_verify = self.costs(rows, k)
        self.age += 1
        if self.age > 200 * self.cost_memory:  # rescale before exp() overflows; drop what has decayed away
            f = math.exp(-self.age / self.cost_memory)
            for by_k in self.timed.values():
                for e in by_k.values():
                    e[0], e[1], e[2] = e[0] * f, e[1] * f, e[2] * f
            self.timed = {r: {k_: e for k_, e in by_k.items() if e[0] > 1e-12} for r, by_k in self.timed.items()}
            self.timed = {r: by_k for r, by_k in self.timed.items() if by_k}
            self.age = 0
        w = math.exp(self.age / self.cost_memory)
        e = self.timed.setdefault((rows, _bucket(ctx)), {}).setdefault(k, [0.0, 0.0, 0.0, 0.0])
        e[0], e[1], e[2], e[3] = e[0] + w, e[1] + w * t_verify, e[2] + w * t_draft, e[3] + 1.0
        R, A = reached.tolist(), accepted.tolist()  # host sync: K numbers
        prev = self.seen or ([0] * len(R), [0] * len(A))
        dR, dA = [x - y for x, y in zip(R, prev[0])], [x - y for x, y in zip(A, prev[1])]
        self.seen = (R, A)
        if dR and dR[0] > 0:
            d = math.exp(-dR[0] / self.accept_memory)
            for j in range(min(len(dR), self.max_k)):
                self.R[j], self.A[j] = d * self.R[j] + dR[j], d * self.A[j] + dA[j]

    # -- the model --------------------------------------------------------------------------------------------------
    def alphas(self) -> list:
        out, prior = [], 0.5
        for R, A in zip(self.R, self.A):
            prior = (A + prior) / (R + 1.0)  # m = 1 pseudo-count towards the position before
            out.append(prior)
        return out

    def costs_at(self, rows: int, ctx: int = None) -> list:
        """c(r, k) for k = 0..K at r = rows and context length ctx (seconds per step), from the timed steps (module
        docstring)."""
        kern = {key: _kernel(key[0], rows, self.h) * _ctx_kernel(key[1], ctx, self.h) for key in self.timed}
        sums, per_k, dw, dt = [0.0] * 5, {}, 0.0, 0.0
        for key, by_k in self.timed.items():
            c = kern[key]
            for k, (w, wv, wd, n) in by_k.items():
                S, cw = k + 1.0, c * w
                sums[0], sums[1], sums[2] = sums[0] + cw, sums[1] + cw * S, sums[2] + cw * S * S
                sums[3], sums[4] = sums[3] + c * wv, sums[4] + c * wv * S
                dw, dt = dw + cw * k, dt + c * wd
                p = per_k.setdefault(k, [0.0, 0.0, 0.0])
                p[0], p[1], p[2] = p[0] + cw, p[1] + c * (wv + wd), p[2] + c * n
        a, b = _solve_affine(*sums) or (0.0, 0.0)
        cd, m, out = dt / dw if dw > 0 else 0.0, 2.0, []
        for k in range(self.max_k + 1):
            prior = a + b * (k + 1) + k * cd
            w, wt, n = per_k.get(k, (0.0, 0.0, 0.0))
            out.append((n * wt / w + m * prior) / (n + m) if w > 0 else prior)
        return out

    def rates(self, rows: int, ctx: int = None) -> list:
        """Expected tokens per second per row, k = 0..K (E[kept | k] / c(r, k))."""
        al, tiny = self.alphas(), 1e-12
        return [expected_kept(al, k) / max(c, tiny) for k, c in enumerate(self.costs_at(rows, ctx))]

    def best(self, rows: int, ctx: int = None) -> int:
        """k* = argmax rate, except that speculation (k > 0) must beat k = 0 by the factor 1 + margin."""
        rates = self.rates(rows, ctx)
        k = max(range(1, self.max_k + 1), key=lambda j: rates[j])
        return k if rates[k] > (1.0 + self.margin) * rates[0] else 0

    def summary(self) -> dict:
        """What the controller believes and did: alpha_j, the steps it ran at each k, the k it ran most."""
        return dict(alpha=[round(a, 3) for a in self.alphas()], steps_at_k=list(self.chosen),
                    k_mode=max(range(self.max_k + 1), key=lambda k: self.chosen[k]),
                    k_mean=round(sum(k * n for k, n in enumerate(self.chosen)) / max(sum(self.chosen), 1), 2))

    def _near(self, rows: int) -> bool:  # a timed batch size within 2x
        return any(abs(math.log(r / rows)) <= math.log(2) for r, _ in self.timed)


class KSchedule:
    """A fixed cycle of k per step, without a clock: the tests switch k mid-generation with it (same hooks).
    off_after=n: from a call's step n + 1 on, k = 0 and `dormant`, as AdaptiveK does once k* = 0."""

    def __init__(self, ks, off_after: int | None = None):
        self.ks, self.max_k, self.i, self.off_after = tuple(ks), max(max(ks), 1), 0, off_after
        self.clock, self.dormant = (lambda: 0.0), False

    def begin(self, K: int, rows: int = None, ctx: int = None):
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the schedule's ceiling K={self.max_k}")
        self.i, self.dormant = 0, self.off_after == 0  # off_after=0: the whole call, without the draft's prefill

    def choose(self, rows: int, ctx: int = None) -> int:
        self.i += 1
        self.dormant = self.off_after is not None and self.i > self.off_after
        return 0 if self.dormant else self.ks[(self.i - 1) % len(self.ks)]

    def record(self, *args, **kw):
        pass


class Backlog:
    """The draft-trunk entries of k = 0 steps, not yet seen by the draft: per step (b, 1) tokens (the token sampled
    after each tapped position) and the policy's taps {layer: (b, 1, H)} there, as draft.extend takes them."""

    def __init__(self):
        self.tokens, self.taps = [], []

    def __bool__(self):
        return bool(self.tokens)

    def push(self, tokens, taps: dict) -> "Backlog":
        self.tokens.append(tokens)
        self.taps.append(taps)
        return self

    def keep(self, rows):  # the batch was compacted to `rows`
        self.tokens = [t[rows] for t in self.tokens]
        self.taps = [{key: v[rows] for key, v in t.items()} for t in self.taps]

    def flush(self, draft, cache):
        """One draft.extend over the L waiting steps (every row advanced by one token in each) -> (h, zq) there."""
        tokens = torch.cat(self.tokens, 1)  # (b, L)
        taps = {key: torch.cat([t[key] for t in self.taps], 1) for key in self.taps[0]}
        self.tokens, self.taps = [], []
        last = torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)
        return draft.extend(cache, tokens, taps, last)
