"""The sums of one co-training update, by name, reduced over the world in one all-reduce (dist_step.py fills them).

The loss and the draft hook add to fp64 tensors on the stage's device with no host sync; after the update one
all_reduce of the fields packed end to end gives the world's sums, and one host read per field gives the step's
statistics. Only last-stage ranks add anything; each adds its CP / DP share. `extra` carries the step's observers'
sums by name (dist_step.StepObserver.collect), reduced in the same all-reduce.

Letters: K trained drafts; m_t = 1 on a trained response token (per prediction), else 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist


@dataclass
class StepTotals:
    clipped: torch.Tensor  # () sum_t m_t [rho_t clipped]
    ratio: torch.Tensor  # () sum_t m_t rho_t
    k3: torch.Tensor  # () sum_t m_t k3_t
    tokens: torch.Tensor  # () sum_t m_t
    gen_err: torch.Tensor  # () sum_t m_t exp|log pi_gen,t - log pi_old,t|   (the rollout's log-probs vs pi_old)
    loss_draft: torch.Tensor  # (K,) each trained draft's loss, averaged over the micro-batches
    extra: dict = field(default_factory=dict)  # {name: () tensor}: the observers' sums

    @classmethod
    def zeros(cls, n_drafts: int, device) -> "StepTotals":
        return cls(*(torch.zeros(() if f.name != "loss_draft" else (n_drafts,), dtype=torch.float64, device=device)
                     for f in fields(cls) if f.name != "extra"))

    def all_reduced(self) -> "StepTotals":
        """The world's sum, from one all-reduce of the fields packed in order (one process: the same values)."""
        names = sorted(self.extra)  # every rank has the same observers, hence the same names
        parts = [getattr(self, f.name) for f in fields(self) if f.name != "extra"] + [self.extra[n] for n in names]
        flat = torch.cat([t.reshape(-1) for t in parts])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        out = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in parts]), parts)]
        return StepTotals(*out[:len(out) - len(names)], extra=dict(zip(names, out[len(out) - len(names):])))

    def mean(self, name: str) -> float:
        """A policy statistic's mean over the step's trained tokens (clip_frac, ratio, k3, gen_err)."""
        return float(getattr(self, name)) / max(float(self.tokens), 1.0)


def gathered(part: dict) -> dict:
    """The union of every rank's `part` (a small dict of host objects: the drafts' metrics per micro-batch), on every
    rank, from one all_gather_object (one process: `part` itself)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return part
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, part)
    return {k: v for p in everyone for k, v in p.items()}
