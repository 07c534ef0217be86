"""One RL step's update: `updates` optimisation steps of the policy (GRPO) and of every draft (any family: EAGLE-3,
DFlash, DSpark; each on the draft's loss), then one refit of the full copies the next rollouts use. The same path at
every world size.

The draft-training budget (--draft_every n): over the run's updates u = 0, 1, 2, ... the drafts train on u % n = 0
only, a 1/n share of the policy's updates; on the others the pipeline runs without taps or draft hook, like plain
GRPO's update. The offline-extended control is given the same number of draft steps ("trained as much").

    up = update(s, batch, timer)      # {"loss_policy", "loss_draft", "kl", "clip_frac", "ratio", "grad_norm",
                                      #  "token_mult_prob_error", "weights_fingerprint",
                                      #  "tau_hat_<arm>", "alpha_<arm>" for every arm}

  1. KL drift    KL(pi_t || pi_0) from the rollouts themselves (rl_loop.rollout_kl: no extra forward);
  2. shuffle     the batch's sequences in a random order, cut into `updates` minibatches (one stream on every rank);
  3. pi_old      from the training forward for every update, never from the rollout: the first update reads its own
                 forward's log-probs (detached: the ratio starts at exactly 1), every later minibatch's come from one
                 no-grad forward through the same path before the first update moves the weights
                 (DistCotrainer.old_logp). The rollout's log-probs (the decode kernels': in bf16 ~1e-3 off) are only
                 compared with them: token_mult_prob_error = mean_t exp|log pi_gen - log pi_old| (NeMo-RL's name;
                 1 when the two paths agree);
     step        dist_step.DistCotrainer.step: ONE policy forward per micro-batch through the pipeline stages (CP inside
                 each stage), GRPO on its log-probs, every draft's loss on its taps (TapChannel) on the last stage;
                 the control arms and the hook's timer ride it as observers (watch.py, step_timer.py);
  4. refit       once, after the last update: the full policy and drafts re-assembled from the stages for the next
                 rollouts (DistCotrainer.refit; the updates read only the stages, and the drafts the stage's own head),
                 then checked: every rank's copies have the same fingerprint (parallel/consistency.py), recorded as
                 weights_fingerprint.
  5. control     the offline-extended arm's steps on fresh pi_0 samples (offline_arm.py; sampled on every rank,
                 trained on rank 0, then broadcast): as many draft steps as the co-trained draft took this step,
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
import torch.distributed as dist

from draft_ttt import merge_metrics
from harness.experiment import watched
from harness.step_timer import HookTimer
from harness.watch import DraftWatch
from rl_loop import RolloutBatch, check_finite_weights, rollout_kl

if TYPE_CHECKING:
    from harness.experiment import Setup


def update(s: Setup, batch: RolloutBatch, timer: dict, step: int = 1) -> dict:
    """Steps 1-5 of RL step `step` (1, 2, ...). timer gains policy_train (the step without the drafts, and the refit),
    draft_train and watch, in wall seconds and, under "cpu", in CPU seconds summed over the ranks (world_cpu). The
    drafts train (and the taps travel) only on the updates the budget picks (cfg.trains_drafts); the offline arm takes
    as many steps."""
    c = s.cfg
    t0, cpu0 = time.perf_counter(), time.process_time()
    kl = rollout_kl(batch) if batch.ref_logp is not None else None  # None: no reference held (cfg.needs_ref)
    perm = torch.randperm(batch.num_seqs, generator=s.perm_gen)
    trains = [c.trains_drafts((step - 1) * c.updates + j) for j in range(c.updates)]
    minibatches = [batch.select(idx.sort().values) for idx in perm.chunk(c.updates)]
    pi_old = [None] + [s.cotrainer.old_logp(b, s.grpo, c.micro_batches) for b in minibatches[1:]]  # before any update
    stats, own = [], [0.0, 0.0]  # own: this process's CPU seconds in the drafts' hook, less the watched arms; theirs
    timers, watches = ([o for o in s.cotrainer.observers if isinstance(o, kind)] for kind in (HookTimer, DraftWatch))
    for j, (b, train) in enumerate(zip(minibatches, trains)):
        stats.append(s.cotrainer.step(b, s.grpo, c.micro_batches, train_drafts=train, on_policy=j == 0,
                                      pi_old=pi_old[j]))  # the first: pi_old is the forward's own log-probs
        hook, watch = sum(o.own_cpu for o in timers), sum(o.own_cpu for o in watches)  # this step's
        own = [own[0] + hook - watch, own[1] + watch]
    prints = s.cotrainer.refit(s.policy)  # once, for the next rollouts; raises unless every rank holds the same
    watch = [st.get("watch_seconds", 0.0) for st in stats]  # the controls' metrics (harness/watch.py)
    drafts = [st.get("hook_seconds", 0.0) - w for st, w in zip(stats, watch)]  # the hook less them (step_timer.py)
    timer["draft_train"] = timer.get("draft_train", 0.0) + sum(drafts)
    timer["watch"] = timer.get("watch", 0.0) + sum(watch)
    timer["policy_train"] = timer.get("policy_train", 0.0) + time.perf_counter() - t0 - sum(drafts) - sum(watch)
    timer["cpu"] = world_cpu({**timer.get("cpu", {}), "draft_train": own[0], "watch": own[1],
                              "policy_train": time.process_time() - cpu0 - sum(own)})
    if s.offline is not None and any(trains):
        timer.update(s.offline.step(sum(trains)))  # as many TTT steps; every rank samples its share, rank 0 trains
        s.offline.broadcast()
    out = {k: sum(st[k] for st in stats) / len(stats) for k in ("loss_policy", "clip_frac", "ratio", "grad_norm")}
    errs = [st["token_mult_prob_error"] for st in stats if st["token_mult_prob_error"] is not None]
    out["token_mult_prob_error"] = sum(errs) / len(errs) if errs else None  # None: no trained token this step
    out.update(draft_metrics(s, [st for st, train in zip(stats, trains) if train]))
    out["kl"] = kl
    out["weights_fingerprint"] = {k: f"{v % 2**64:016x}" for k, v in prints.items()}  # the same on every rank
    return out


def world_cpu(cpu: dict) -> dict:
    """Each phase's CPU seconds summed over every rank's process (one process: its own): a step's CPU work on the
    whole mesh, whichever rank does it (the drafts train on the last stage only)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return cpu
    keys = sorted(cpu)
    t = torch.tensor([cpu[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)  # a few floats on the host: the world group carries CPU tensors over gloo (harness/mesh.py)
    return dict(zip(keys, t.tolist()))


def draft_metrics(s: Setup, stats: list) -> dict:
    """tau_hat_<arm>, alpha_<arm> pooled over the updates that trained the drafts, and loss_draft (the co-trained
    draft's); None where no update of the step did."""
    out, names = {}, list(s.drafts) + [n for n, _ in watched(s)]
    for i, name in enumerate(names):
        m = merge_metrics([(st["draft_metrics"] + st["observed_metrics"])[i] for st in stats]) or {}
        out[f"tau_hat_{name}"], out[f"alpha_{name}"] = m.get("tau_hat"), m.get("alpha")
    out["loss_draft"] = sum(st["loss_draft"][0] for st in stats) / len(stats) if stats and s.drafts else None
    return out


def check_finite(step: int, up: dict, s: Setup):
    """Stop the run at the first NaN/inf loss or weight, naming it (every rank holds the same reduced values and the
    same refitted full copies: all ranks stop). A finite loss can still be followed by an update that overflows the
    weights (too large a learning rate), which would only surface later as a sampling error: the weights are checked
    too, once per step."""
    hint = "stopping. Try a lower --lr / --draft_lr or a smaller --grad_clip / --draft_grad_clip"
    for key in ("loss_policy", "loss_draft", "grad_norm"):
        if up[key] is not None and not math.isfinite(up[key]):  # loss_draft None: no draft trained this step
            raise FloatingPointError(f"step {step}: {key} = {up[key]} (not finite); {hint}")
    for name, m in {"policy": s.policy, **{f"{name} draft": tr.draft for name, tr in s.drafts.items()}}.items():
        check_finite_weights(m, f"step {step}: after the update, the {name}", hint)
