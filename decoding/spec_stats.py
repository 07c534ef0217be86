"""What a speculative.generate call measures besides its tokens: counts per call, per prompt and per draft position,
the uncut acceptance length, the KV caches' peak, the wall time.

The engine keeps one `SpecCounts` per call (speculative._Decode.counts) and calls it at three places: `step` after
each commit (device tensors only, no host sync), `saw_caches` at each step's poll (host ints), `stats` at the end (the
one read of the counters). The acceptance length is defined once, in speculative.py's docstring; `stats` computes it.

vLLM's spec-decode counters count the forward in which a row stops whole (its scheduler counts a row's accepted drafts
before it cuts them at the stop token or max_tokens). SpecStats.acceptance_length_uncut is that count, for comparing
with it:
    acceptance length, uncut = 1 + sum_forwards (drafts the rule accepts, n) / sum_forwards (rows active in it)

Letters: B prompts, b rows still in the batch, k this step's draft tokens, K the call's ceiling of k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    policy_forwards: int = 0  # verification (or, without a draft, decode) forwards after the prefill
    row_steps: int = 0  # sum over those forwards of the rows still generating
    drafted: int = 0  # draft tokens proposed to active rows
    accepted: int = 0  # draft tokens kept: kept - row_steps (a row's last forward counts only up to EOS / budget)
    kept: int = 0  # tokens kept from those forwards, summed over rows (= new_tokens - rows that got a prefill token)
    acceptance_length: float = 1.0  # kept / row_steps: tokens kept per policy forward per row, bonus included
    accepted_uncut: int = 0  # drafts the rule accepted (n), a row's stopping forward counted whole (vLLM's counter)
    acceptance_length_uncut: float = 1.0  # 1 + accepted_uncut / row_steps: what vLLM's counters give (module doc)
    accept_per_position: list = field(default_factory=list)  # alpha_j = P(d_j accepted | d_<j accepted), kept positions
    new_tokens: int = 0  # tokens returned (after EOS / max_new_tokens truncation)
    row_kept: list = field(default_factory=list)  # per prompt: its share of `kept` (paired per-prompt comparisons)
    row_forwards: list = field(default_factory=list)  # per prompt: verification forwards it was active in
    row_tried: list = field(default_factory=list)  # per prompt: its drafts tried at positions 1..K (kept positions)
    row_accepted: list = field(default_factory=list)  # per prompt: of which accepted
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    kv_peak_bytes: int = 0  # the most bytes both KV caches held together, read at each step's poll (host ints)


class SpecCounts:
    """The counters of one generate call, on the device until `stats` reads them.

    B prompts; K the ceiling of k (the per-position counts are sized for it); k the call's draft width (0: no draft).
    `reached` / `accepted` (K,) are the call's per-position counts a k controller reads after each step
    (decoding/k_control.py); a tree's verify_step adds its per-depth counts to them."""

    def __init__(self, B: int, K: int, k: int, device):
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        self.K = K
        self.reached, self.accepted = zeros(max(K, 1)), zeros(max(K, 1))  # (K,) drafts tried / accepted, per position
        self.kept, self.n, self.row_steps = zeros(), zeros(), zeros()  # tokens kept, drafts accepted (n), active rows
        self.drafted = 0  # draft tokens proposed to active rows (a device scalar once a step drafts)
        self.row_kept, self.row_fwd, self.row_acc = zeros(B), zeros(B), zeros(B)  # (B,) per prompt
        self.row_tried = zeros(B, max(k, 1))  # (B, K) per prompt: drafts tried at each position
        self.policy_forwards, self.kv_peak_bytes = 0, 0  # host ints

    def step(self, s, n, kept, active):
        """One verification forward committed: s the engine's state (its k, its rows s.live, s.lengths), n (b,) the
        drafts the rule accepted, kept (b,) the tokens each row keeps (speculative.kept_tokens), active (b,) bool the
        rows that were still generating."""
        if s.k:  # per position j: draft j tried (j <= n) / accepted (j < n), among the positions the row keeps
            j = torch.arange(s.k, device=n.device)[None]
            tried, acc = (j <= n[:, None]) & (j < kept[:, None]), (j < n[:, None]) & (j < kept[:, None])  # (b, k)
            if s.lengths is not None:  # a slot past the row's cut was not proposed: not tried
                tried = tried & (j < s.lengths[:, None])
            self.reached[: s.k] += tried.sum(0)
            self.accepted[: s.k] += acc.sum(0)
            self.row_tried[s.live, : s.k] += tried  # per prompt (the rows' spread, adaptive_k.AdaptiveK.end)
            self.row_acc[s.live] += acc.sum(1)
            proposed = s.k * active.sum() if s.lengths is None else torch.where(active, s.lengths, 0).sum()
            self.drafted = self.drafted + proposed
        self.kept += kept.sum()
        self.n += torch.where(active, n, 0).sum()
        self.row_steps += active.sum()
        self.row_kept[s.live] += kept
        self.row_fwd[s.live] += active.long()
        self.policy_forwards += 1

    def saw_caches(self, caches):
        """At each step's poll: the KV caches' bytes together (host ints, kv_cache.KVCache.allocated_bytes)."""
        self.kv_peak_bytes = max(self.kv_peak_bytes, sum(c.allocated_bytes() for c in caches))

    def stats(self, n_keep: list, seconds: float) -> SpecStats:
        """The call's SpecStats: n_keep the tokens returned per prompt, seconds its wall time."""
        st = SpecStats(policy_forwards=self.policy_forwards, kv_peak_bytes=self.kv_peak_bytes, seconds=seconds)
        st.row_steps, st.kept = int(self.row_steps), int(self.kept)
        st.acceptance_length = st.kept / max(st.row_steps, 1)
        st.drafted, st.accepted = int(self.drafted), st.kept - st.row_steps
        st.accepted_uncut = int(self.n)
        st.acceptance_length_uncut = 1 + st.accepted_uncut / max(st.row_steps, 1)
        st.accept_per_position = (self.accepted.float() / self.reached.clamp_min(1)).tolist() if self.K else []
        st.new_tokens, st.tokens_per_s = sum(n_keep), sum(n_keep) / seconds
        st.row_kept, st.row_forwards = self.row_kept.tolist(), self.row_fwd.tolist()
        st.row_tried, st.row_accepted = self.row_tried.tolist(), self.row_acc.tolist()
        return st
