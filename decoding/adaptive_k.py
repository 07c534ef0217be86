"""Adaptive speculation length: the number of draft tokens k in {0, ..., K} chosen at every decode step of a chain
draft from costs and acceptance measured online (speculative.generate(adapt=AdaptiveK(K))). k = 0 is plain
autoregressive decoding.

The cost model. With r rows in the batch, one step at k keeps E[kept | k] tokens per row and takes c(r, k) seconds;
the controller picks the k with the most tokens per second:

    k* = argmax_{k = 0..K}  E[kept | k] / c(r, k)

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
most and nothing is keyed by batch size or temperature. Timings are the clock's, taken around the draft's work and
around the rest of the step (speculative.chain_step); a `costs(rows, k) -> (draft s, verify s)` source replaces them
(tests, simulations). The first steps, and the first at a batch size more than 2x away from every timed one, are probes:
k = K, 0, 1, twice, so S and k both vary before the fit is used.

k = 0 runs no draft pass: the policy's taps of those steps wait in a Backlog, and the draft's trunk extends over them
in one forward at the next step with k > 0 (that catch-up is not charged to the fit). While k* = 0 no acceptance is
observed (nothing decays), so every `explore_every` steps at k = 0 one step runs at the best k >= 1.

Lossless at every k: each step is an exact speculative-sampling step whatever k is, and k depends only on the past.
But the sampled tokens then depend on the clock (a run is not reproducible from its seed), so the adaptive k is
opt-in (--num_draft_tokens=auto); KSchedule (a fixed cycle of k, no clock) is how the tests switch k mid-generation.
On a GPU pass a clock that synchronizes the device (for_device) or the timings see only the kernel launches.

    expected_kept(alphas, k), fit_verify_naive(obs, r, ...)   the formulas above on plain lists (the references)

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


def _solve_affine(w, ws, wss, wt, wst):
    """Weighted least squares t = a + b S from the sums of w, w S, w S^2, w t, w S t; b >= 0 (more tokens never
    cost less), b = 0 when S did not vary."""
    if w <= 0:
        return None
    ms, mt = ws / w, wt / w
    var = wss / w - ms * ms
    b = max((wst / w - ms * mt) / var, 0.0) if var > 1e-12 else 0.0
    return mt - b * ms, b


def fit_verify_naive(obs, r: float, memory: float, h: float):
    """The reference for AdaptiveK's verify fit: obs [(rows, S, seconds)] oldest first -> (a, b) at r, by the
    weighted sums written out (weights exp(-age / memory) * kernel(rows, r))."""
    sums = [0.0] * 5
    for age, (r_i, S, t) in enumerate(reversed(obs)):
        w = math.exp(-age / memory) * _kernel(r_i, r, h)
        for i, v in enumerate((w, w * S, w * S * S, w * t, w * S * t)):
            sums[i] += v
    return _solve_affine(*sums)


class AdaptiveK:
    """The controller: choose(rows) -> k before a step, record(...) after it. One instance lives across engine calls
    (its measurements carry over); begin(K) starts a call."""

    def __init__(self, max_k: int, *, clock=time.perf_counter, costs=None, accept_memory: float = 1000.0,
                 cost_memory: float = 64.0, bandwidth: float = 0.35, explore_every: int = 32, probe_rounds: int = 2):
        if not (isinstance(max_k, int) and max_k >= 1):
            raise ValueError(f"max_k={max_k!r}: expected an int >= 1 (the ceiling K of the adaptive k)")
        self.max_k, self.clock, self.costs = max_k, clock, costs
        self.accept_memory, self.cost_memory, self.h = accept_memory, cost_memory, bandwidth
        self.explore_every, self.probes = explore_every, (max_k, 0, 1) * probe_rounds
        self.R, self.A = [0.0] * max_k, [0.0] * max_k  # decayed drafts tried / accepted per position
        self.verify = {}  # rows -> decayed sums [w, w S, w S^2, w t, w S t] of the timed steps at that batch size
        self.draft = {}  # rows -> decayed sums [w, w t / k]
        self.queue, self.zero_run, self.seen = [], 0, None
        self.chosen = [0] * (max_k + 1)  # steps run at each k (reporting)

    @classmethod
    def for_device(cls, max_k: int, device, **kw) -> "AdaptiveK":
        """A controller whose clock waits for the device's queued work (CUDA), else time.perf_counter."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return cls(max_k, **kw)
        return cls(max_k, clock=lambda: (torch.cuda.synchronize(dev), time.perf_counter())[1], **kw)

    # -- the engine's hooks -----------------------------------------------------------------------------------------
    def begin(self, K: int):
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the controller's ceiling K={self.max_k}")
        self.seen = None  # the call's cumulative per-position counts start at 0

    def choose(self, rows: int) -> int:
        """k for the next step at `rows` batch rows."""
        if not self.queue and not self._near(rows):
            self.queue = list(self.probes)
        if self.queue:
            k = self.queue.pop(0)
        else:
            k = self.best(rows)
            self.zero_run = self.zero_run + 1 if k == 0 else 0
            if self.zero_run > self.explore_every:  # refresh the acceptance k = 0 cannot see
                self.zero_run, k = 0, self.best(rows, lo=1)
        self.chosen[k] += 1
        return k

    def record(self, rows: int, k: int, t_draft: float, t_verify: float, reached, accepted):
        """After a step: its seconds drafting / verifying, and the call's cumulative per-position counts (K,)."""
        if self.costs is not None:
            t_draft, t_verify = self.costs(rows, k)
        g = math.exp(-1.0 / self.cost_memory)
        _add(self.verify, rows, g, (1.0, k + 1.0, (k + 1.0) ** 2, t_verify, (k + 1.0) * t_verify))
        if k:
            _add(self.draft, rows, g, (1.0, t_draft / k))
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

    def fit(self, rows: int):
        """(a, b, c_draft) at `rows`; None where nothing was timed."""
        v = self._sums(self.verify, rows, 5)
        d = self._sums(self.draft, rows, 2)
        ab = _solve_affine(*v) if v else None
        return (*(ab or (None, None)), d[1] / d[0] if d and d[0] > 0 else None)

    def rates(self, rows: int) -> list:
        """Expected tokens per second per row, k = 0..K (E[kept | k] / c(r, k))."""
        a, b, cd = self.fit(rows)
        al, tiny = self.alphas(), 1e-12
        a, b, cd = a or 0.0, b or 0.0, cd or 0.0
        return [expected_kept(al, k) / max(a + b * (k + 1) + k * cd, tiny) for k in range(self.max_k + 1)]

    def best(self, rows: int, lo: int = 0) -> int:
        rates = self.rates(rows)
        return max(range(lo, self.max_k + 1), key=lambda k: rates[k])

    def summary(self) -> dict:
        """What the controller believes and did: alpha_j, the steps it ran at each k, the k it ran most."""
        return dict(alpha=[round(a, 3) for a in self.alphas()], steps_at_k=list(self.chosen),
                    k_mode=max(range(self.max_k + 1), key=lambda k: self.chosen[k]),
                    k_mean=round(sum(k * n for k, n in enumerate(self.chosen)) / max(sum(self.chosen), 1), 2))

    def _near(self, rows: int) -> bool:  # a timed batch size within 2x
        return any(abs(math.log(r / rows)) <= math.log(2) for r in self.verify)

    def _sums(self, table: dict, rows: int, n: int):
        if not table:
            return None
        kern = {r: _kernel(r, rows, self.h) for r in table}
        top = max(kern.values())
        if top <= 0:
            return None
        return [sum(kern[r] / top * s[i] for r, s in table.items()) for i in range(n)]


def _add(table: dict, rows: int, g: float, obs: tuple):
    """Decay every batch size's sums by g (one more step has happened), then add this step's at `rows`."""
    for r in list(table):
        s = table[r] = [g * v for v in table[r]]
        if s[0] < 1e-9:
            del table[r]
    s = table.setdefault(rows, [0.0] * len(obs))
    for i, v in enumerate(obs):
        s[i] += v


class KSchedule:
    """A fixed cycle of k per step, without a clock: the tests switch k mid-generation with it (same hooks)."""

    def __init__(self, ks):
        self.ks, self.max_k, self.i = tuple(ks), max(ks), 0
        self.clock = lambda: 0.0

    def begin(self, K: int):
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the schedule's ceiling K={self.max_k}")

    def choose(self, rows: int) -> int:
        self.i += 1
        return self.ks[(self.i - 1) % len(self.ks)]

    def record(self, *args):
        pass


class Backlog:
    """The draft-trunk entries of k = 0 steps, not yet seen by the draft: per step (b, 1) tokens (the token sampled
    after each tapped position) and the policy's taps {layer: (b, 1, H)} there, as draft.extend takes them."""

    def __init__(self):
        self.tokens, self.taps = [], []

    def __bool__(self):
        return bool(self.tokens)

    def push(self, tokens, taps: dict):
        self.tokens.append(tokens)
        self.taps.append(taps)

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
