"""The end-to-end RL step, measured: a co-trained speculative run against a plain-GRPO run (--no_spec) of the same
experiment (same seeds and prompts), step by step, from the timers both runs recorded.

    m = measured_e2e(run_rows, base_rows)       # {"e2e_step_speedup_measured", its 95% interval, ..., per component}
    python -m harness.report RUN --baseline BASE_RUN     # prints the comparison, adds it to RUN/summary.json

Per step i (wall seconds, and CPU seconds summed over the run's processes where it recorded them):

    spec_i  = t_rollout + t_policy_train + t_draft_train / trained_drafts      the co-trained run's own work
    plain_i = t_rollout + t_policy_train                                        the --no_spec run (no draft, no taps)
    e2e_step_speedup_measured = sum_i plain_i / sum_i spec_i

t_draft_train holds every draft trained on the taps (co-trained, and the cold arm when on; they are the same size, so
the co-trained one's share is 1 / trained_drafts); the other controls (the frozen and offline-extended arms' metrics,
"watch"; the offline arm's sampling and training, "offline_*") and the evaluations are not part of either step. Both
runs compute the reference log-probs inside t_rollout when they hold a reference (the same flags: the same cost).

The interval: a paired bootstrap over steps -- resample step indices with replacement (the same indices in both runs),
recompute the ratio of sums, take the 2.5 / 97.5 percentiles [Efron & Tibshirani 1993, percentile interval]. It
covers the step-to-step spread of one pair of runs, not the spread between seeds (the seeds table shows that).
"""
from __future__ import annotations

import json
import os

import torch

PARTS = ("rollout", "policy_train", "draft_train")


def trained_drafts(row: dict) -> int:
    """How many drafts a step trained on the taps: the co-trained one and the cold arm, when the run held them."""
    return sum(f"tau_hat_{arm}" in row for arm in ("cotrained", "cold"))


def step_parts(rows: list, cpu: bool = False) -> dict | None:
    """component -> (steps,) seconds of the run's own work per step (wall, or CPU: None when a step lacks them); the
    drafts' time is the co-trained draft's share."""
    out = {p: [] for p in PARTS}
    for r in rows:
        t = r["time"].get("cpu") if cpu else r["time"]
        if t is None:
            return None
        n = trained_drafts(r)
        for p in PARTS:
            out[p].append(t.get(p, 0.0) / (n if p == "draft_train" and n else 1))
    return {p: torch.tensor(v, dtype=torch.float64) for p, v in out.items()}


def ratio_interval(plain: torch.Tensor, spec: torch.Tensor, n: int = 2000, seed: int = 0) -> list:
    """95% paired-bootstrap percentile interval of sum(plain) / sum(spec) over steps (both (S,))."""
    idx = torch.randint(len(plain), (n, len(plain)), generator=torch.Generator().manual_seed(seed))  # (n, S)
    r = plain[idx].sum(1) / spec[idx].sum(1)
    return [float(torch.quantile(r, 0.025)), float(torch.quantile(r, 0.975))]


def measured_e2e(rows: list, base_rows: list, n_boot: int = 2000, seed: int = 0) -> dict:
    """The comparison of the co-trained run's train records `rows` with the plain run's `base_rows`, on the steps both
    have. Raises ValueError when the baseline trained a draft or the spec run did not."""
    if not rows or not base_rows:
        raise ValueError("measured_e2e: a run without train records (is it finished?)")
    if any(trained_drafts(r) for r in base_rows):
        raise ValueError("baseline: trained a draft; expected a plain-GRPO run (train.py --no_spec)")
    if not all(trained_drafts(r) for r in rows):
        raise ValueError("run: has no co-trained draft (a --no_spec run); expected the speculative run")
    S = min(len(rows), len(base_rows))
    out = {"e2e_steps_compared": S}
    for unit, cpu in (("", False), ("_cpu", True)):
        a, b = step_parts(rows[:S], cpu), step_parts(base_rows[:S], cpu)
        if a is None or b is None:
            continue
        spec, plain = sum(a.values()), b["rollout"] + b["policy_train"]
        out[f"e2e_step_speedup_measured{unit}"] = float(plain.sum() / spec.sum())
        out[f"e2e_step_speedup_measured{unit}_ci"] = ratio_interval(plain, spec, n_boot, seed)
        out[f"e2e_step_speedup_measured{unit}_median_step"] = float((plain / spec).median())
        out[f"e2e_step_s_spec_measured{unit}"] = float(spec.mean())
        out[f"e2e_step_s_plain{unit}"] = float(plain.mean())
        out[f"e2e_parts{unit}"] = {"spec": {p: float(v.mean()) for p, v in a.items()},
                                   "plain": {p: float(b[p].mean()) for p in PARTS[:2]}}
    return out


def read_rows(run_dir: str) -> list:
    """The train records of <run_dir>/metrics.jsonl, in step order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (expected a train.py output directory)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])


def table(m: dict) -> str:
    """The comparison as markdown: per component and per step, wall and CPU seconds."""
    units = [u for u in ("", "_cpu") if f"e2e_parts{u}" in m]
    lines = ["| seconds per step | " + " | ".join("CPU" if u else "wall" for u in units) + " |",
             "|---|" + "---:|" * len(units)]
    for p in PARTS:
        for arm in ("spec", "plain"):
            if p in m[f"e2e_parts{units[0]}"][arm]:
                lines.append(f"| {p}, {'co-trained spec' if arm == 'spec' else 'plain GRPO'} | "
                             + " | ".join(f"{m[f'e2e_parts{u}'][arm][p]:.3f}" for u in units) + " |")
    lines.append("| step, co-trained spec | " + " | ".join(f"{m[f'e2e_step_s_spec_measured{u}']:.3f}" for u in units)
                 + " |")
    lines.append("| step, plain GRPO | " + " | ".join(f"{m[f'e2e_step_s_plain{u}']:.3f}" for u in units) + " |")
    lines.append("| e2e step speedup (95% CI over steps) | " + " | ".join(
        f"{m[f'e2e_step_speedup_measured{u}']:.3f} [{m[f'e2e_step_speedup_measured{u}_ci'][0]:.3f}, "
        f"{m[f'e2e_step_speedup_measured{u}_ci'][1]:.3f}]" for u in units) + " |")
    return "\n".join(lines)
