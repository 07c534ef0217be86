"""One RL step's update: `updates` optimisation steps of the policy (GRPO) and of every draft (TTT), each followed by
a refit of the full copies the next rollouts use. The same path at every world size.

    up = update(s, batch, timer)      # {"loss_policy", "loss_draft", "kl", "clip_frac", "ratio", "grad_norm",
                                      #  "tau_hat_<arm>", "alpha_<arm>" for every arm}

  1. KL drift    KL(pi_t || pi_0) from the rollouts themselves (rl_loop.rollout_kl: no extra forward);
  2. shuffle     the batch's sequences in a random order, cut into `updates` minibatches (one stream on every rank);
  3. step        dist_step.DistCotrainer.step: ONE policy forward per micro-batch through the pipeline stages (CP inside
                 each stage), GRPO on its log-probs, every draft's TTT loss on its taps (TapChannel) on the last stage;
                 rl_loop.cotrain_step is the naive single-process reference it equals (tests/test_dist_step.py);
  4. refit       the full policy and drafts re-assembled from the stages (DistCotrainer.refit).
  5. control     the offline-extended arm's step on fresh pi_0 samples (offline_arm.py; sampled on every rank, trained
                 on rank 0, then broadcast),
                 timed apart ("offline"): it is the control's cost, not the co-trained run's.

Teacher-forced acceptance per arm and step: the draft hook's metrics on this step's rollouts, every micro-batch of
every update pooled by their anchor counts (draft_ttt.merge_metrics) -- alpha_j = E sum_x min(p_j(x), q_j(x)) per TTT
pass j and tau_hat = 1 + sum_k prod_{j<=k} alpha_j -- for the trained arms (co-trained, cold) and, forward only, the
watched ones (frozen, offline-extended).

check_finite stops the run at the first NaN/inf loss or weight, naming it.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from draft_ttt import merge_metrics
from harness.experiment import watched
from rl_loop import RolloutBatch, check_finite_weights, rollout_kl

if TYPE_CHECKING:
    from harness.experiment import Setup


def update(s: Setup, batch: RolloutBatch, timer: dict) -> dict:
    """Steps 1-4. timer gains policy_train (the step without the drafts, and the refit) and draft_train."""
    t0 = time.perf_counter()
    kl = rollout_kl(batch)
    perm = torch.randperm(batch.num_seqs, generator=s.perm_gen)
    stats = []
    for idx in perm.chunk(s.cfg.updates):
        stats.append(s.cotrainer.step(batch.select(idx.sort().values), s.grpo, s.cfg.micro_batches))
        s.cotrainer.refit(s.policy)
    draft_s = sum(st["draft_seconds"] for st in stats)
    timer["draft_train"] = timer.get("draft_train", 0.0) + draft_s
    watch_s = sum(st["watch_seconds"] for st in stats)
    timer["policy_train"] = timer.get("policy_train", 0.0) + time.perf_counter() - t0 - draft_s - watch_s
    timer["watch"] = timer.get("watch", 0.0) + watch_s  # the controls' teacher-forced metrics: not the run's cost
    if s.offline is not None:
        timer.update(s.offline.step())  # every rank samples its share, rank 0 trains
        s.offline.broadcast()
    out = {k: sum(st[k] for st in stats) / len(stats) for k in ("loss_policy", "clip_frac", "ratio", "grad_norm")}
    names = list(s.drafts) + [n for n, _ in watched(s)]
    for i, name in enumerate(names):
        m = merge_metrics([(st["draft_metrics"] + st["watch_metrics"])[i] for st in stats])
        out[f"tau_hat_{name}"], out[f"alpha_{name}"] = m["tau_hat"], m["alpha"]
    out["loss_draft"] = sum(st["loss_draft"][0] for st in stats) / len(stats)
    out["kl"] = kl
    return out


def check_finite(step: int, up: dict, s: Setup):
    """Stop the run at the first NaN/inf loss or weight, naming it (every rank holds the same reduced values and the
    same refitted full copies: all ranks stop). A finite loss can still be followed by an update that overflows the
    weights (too large a learning rate), which would only surface later as a sampling error: the weights are checked
    too, once per step."""
    hint = "stopping. Try a lower --lr / --draft_lr or a smaller --grad_clip / --draft_grad_clip"
    for key in ("loss_policy", "loss_draft", "grad_norm"):
        if not math.isfinite(up[key]):
            raise FloatingPointError(f"step {step}: {key} = {up[key]} (not finite); {hint}")
    for name, m in {"policy": s.policy, **{f"{name} draft": tr.draft for name, tr in s.drafts.items()}}.items():
        check_finite_weights(m, f"step {step}: after the update, the {name}", hint)
