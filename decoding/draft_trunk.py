"""The draft's side of one speculative.generate call: the trunk, i.e. the draft's KV cache over the verified tokens
and its state at the last of them (drafter.py: what `extend` returns and `propose` reads).

Each step appends the kept entries (entry j = the token after position j, the policy's taps at j). A step that drafted
nothing (k = 0: a one-token block) needs no draft forward of its own, so its entry waits, and the next proposal extends
the trunk over all waiting entries in one forward (the catch-up). A call that will not draft again releases the draft:
the policy stops tapping and the cache is freed.

Letters: b batch rows, L waiting steps, H hidden.
"""
from __future__ import annotations

import torch


def select_rows(state: tuple, rows: torch.Tensor) -> tuple:
    """A drafter's state (a tuple of (b, ...) tensors) for the batch rows `rows` (compaction)."""
    return tuple(t[rows] for t in state)


class DraftTrunk:
    """draft None (or released): plain sampling, every method a no-op and tap_layers None."""

    def __init__(self, draft=None, cache=None, state: tuple = None):
        self.draft, self.cache, self.state = draft, cache, state
        self.tap_layers = None if draft is None else draft.tap_layers  # the policy layers the draft reads
        self.waiting = []  # per k = 0 step: tokens (b, 1), the token sampled after each tapped position; taps (b, 1, H)

    def extend(self, block, taps: dict, n):
        """The kept entries of a step: block (b, k+1) its tokens, taps {layer: (b, k+1, H)}, row b keeps 0..n[b]."""
        if self.draft is None:
            return
        if block.shape[1] == 1:  # nothing was drafted: the entry waits for the next proposal
            self.waiting.append((block, taps))
            return
        self.state = self.draft.extend(self.cache, block, taps, n)

    def propose(self, k: int, temperature: float, generator):
        """d (b, k) ~ q and q (b, k, V) (None at tau = 0) from the state at the last verified token."""
        if self.waiting:  # the catch-up: one draft.extend over the L waiting one-token entries
            tokens = torch.cat([t for t, _ in self.waiting], 1)  # (b, L)
            taps = {key: torch.cat([tp[key] for _, tp in self.waiting], 1) for key in self.waiting[0][1]}
            last = torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)
            self.waiting, self.state = [], self.draft.extend(self.cache, tokens, taps, last)
        return self.draft.propose(self.cache, self.state, k, temperature, generator)

    def keep_rows(self, rows):
        """Compaction: keep these batch rows (b',), in this order."""
        if self.draft is None:
            return
        self.cache.keep_rows(rows)
        self.state = select_rows(self.state, rows)
        self.waiting = [(t[rows], {key: v[rows] for key, v in tp.items()}) for t, tp in self.waiting]

    def empty_finished(self, done):
        """Rows that finished restart their cache at 0: while they ride along until compaction they never grow."""
        if self.draft is not None:
            self.cache.rollback(torch.where(done, 0, self.cache.lengths))

    def release(self):
        """No more drafting in this call: no taps, the waiting entries dropped, the cache freed."""
        self.draft = self.cache = self.state = self.tap_layers = None
        self.waiting = []
