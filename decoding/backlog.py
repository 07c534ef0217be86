"""The draft trunk's backlog while k = 0 inside a run of speculation (decoding/adaptive_k.py): the policy's taps of
autoregressive steps wait here, and the next step with k > 0 extends the draft's trunk over all of them in one
forward (the catch-up)."""
from __future__ import annotations

import torch


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
        """One draft.extend over the L waiting steps (every row advanced by one token in each) -> the draft's state
        there (drafter.py)."""
        tokens = torch.cat(self.tokens, 1)  # (b, L)
        taps = {key: torch.cat([t[key] for t in self.taps], 1) for key in self.taps[0]}
        self.tokens, self.taps = [], []
        last = torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)
        return draft.extend(cache, tokens, taps, last)
