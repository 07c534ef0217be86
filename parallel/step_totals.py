"""The sums of one co-training update, by name, reduced over the world in one all-reduce (dist_step.py fills them).

The loss and the draft hook add to fp64 tensors on the stage's device with no host sync; after the update one
all_reduce of the fields packed end to end gives the world's sums, and one host read per field gives the step's
statistics. Only last-stage ranks add anything; each adds its CP / DP share (the times: its own divided by cp * dp, so
the sum is the last stage's mean).

Letters: K trained drafts; m_t = 1 on a trained response token (per prediction), else 0.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist


@dataclass
class StepTotals:
    clipped: torch.Tensor  # () sum_t m_t [rho_t clipped]
    ratio: torch.Tensor  # () sum_t m_t rho_t
    k3: torch.Tensor  # () sum_t m_t k3_t
    tokens: torch.Tensor  # () sum_t m_t
    gen_err: torch.Tensor  # () sum_t m_t exp|log pi_gen,t - log pi_old,t|   (the rollout's log-probs vs pi_old)
    draft_seconds: torch.Tensor  # () wall seconds in the draft hook and its backward, the watched arms' excluded
    watch_seconds: torch.Tensor  # () wall seconds of the watched arms (DistCotrainer's `watch`)
    draft_cpu_seconds: torch.Tensor  # () the same two in CPU seconds
    watch_cpu_seconds: torch.Tensor
    loss_draft: torch.Tensor  # (K,) each trained draft's loss, averaged over the micro-batches

    @classmethod
    def zeros(cls, n_drafts: int, device) -> "StepTotals":
        return cls(*(torch.zeros(() if f.name != "loss_draft" else (n_drafts,), dtype=torch.float64, device=device)
                     for f in fields(cls)))

    def all_reduced(self) -> "StepTotals":
        """The world's sum, from one all-reduce of the fields packed in order (one process: the same values)."""
        parts = [getattr(self, f.name) for f in fields(self)]
        flat = torch.cat([t.reshape(-1) for t in parts])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        return StepTotals(*(t.view_as(p) for t, p in zip(flat.split([p.numel() for p in parts]), parts)))

    def mean(self, name: str) -> float:
        """A policy statistic's mean over the step's trained tokens (clip_frac, ratio, k3, gen_err)."""
        return float(getattr(self, name)) / max(float(self.tokens), 1.0)
