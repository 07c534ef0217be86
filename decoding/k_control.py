"""How many tokens the draft proposes at each step of speculative.generate: the controller that generate asks.

    ctl.begin(K, rows, ctx, left) -> bool   a call starts: K the ceiling of k, rows its batch, ctx its longest prompt,
                                            left its max_new_tokens. False: the call never drafts (plain sampling,
                                            no draft prefill)
    ctl.k(s) -> int                         before each step: k in 0..K, 0 a plain autoregressive step. s is the
                                            engine's state (speculative._Decode): rows s.live, context s.pcache.bound,
                                            the most tokens a row may still take s.left, open rows s.open. A
                                            controller that will not draft again in the call releases the draft
                                            (s.trunk.release(): no taps, no catch-up; decoding/draft_trunk.py)
    ctl.observe(s)                          after the step: its k s.k, the call's per-position counts
                                            s.counts.reached / s.counts.accepted (K,) (spec_stats.py)
    ctl.end(rollout) -> rollout             the call ended (its per-row counts are in rollout.stats)

FixedK(k): k at every step, the paper's engine (generate's default). KSchedule: a fixed cycle of k without a clock,
how the tests switch k mid-call. AdaptiveK (adaptive_k.py): k from costs and acceptance measured online. Every k
leaves the samples exact: the accept / residual rule does not depend on it.
"""
from __future__ import annotations


class FixedK:
    """k draft tokens at every step; k = 0 is plain sampling (no draft at all)."""

    def __init__(self, k: int):
        self.max_k = k

    def begin(self, K: int, rows: int = None, ctx: int = None, left: int = None) -> bool:
        return K > 0

    def k(self, s) -> int:
        return self.max_k

    def observe(self, s):
        pass

    def end(self, rollout):
        return rollout


class KSchedule(FixedK):
    """A fixed cycle of k per step, restarted at each call. off_after=n: from a call's step n + 1 on, k = 0 and the
    draft released, as AdaptiveK does once k* = 0 (off_after=0: the whole call, without the draft's prefill)."""

    def __init__(self, ks, off_after: int | None = None):
        super().__init__(max(max(ks), 1))
        self.ks, self.i, self.off_after = tuple(ks), 0, off_after

    def begin(self, K: int, rows: int = None, ctx: int = None, left: int = None) -> bool:
        if K != self.max_k:
            raise ValueError(f"num_draft_tokens={K}: with adapt= expected the schedule's ceiling K={self.max_k}")
        self.i = 0
        return self.off_after != 0

    def k(self, s) -> int:
        self.i += 1
        if self.off_after is not None and self.i > self.off_after:
            s.trunk.release()
            return 0
        return self.ks[(self.i - 1) % len(self.ks)]
