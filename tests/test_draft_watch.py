"""The step's observers (dist_step.StepObserver): the watched arms (harness/watch.py's DraftWatch) ride the update's
draft hook, read from the same taps, teacher and loss options as the trained drafts, forward only; the hook's timer
(harness/step_timer.py) times the hook, the watched arms' reads within it, which are reported apart.
One process, fp64, the 1 x 1 x 1 grid (tests/test_dist_step.py runs the step on 4 gloo ranks). ~4 s on 2 cores."""
import copy

import pytest
import torch

from dist_step import DistCotrainer
from harness.step_timer import HookTimer
from harness.watch import DraftWatch
from parallel.grid import Grid
from test_dist_step import grpo, make_batch, make_models, make_policy_opt


def test_a_watched_copy_reads_what_the_trained_draft_reads_and_stays_untouched():
    policy, drafts = make_models()
    twin = copy.deepcopy(drafts[0].draft)  # the rollout draft as it is before the step
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    timer, watch = HookTimer(), DraftWatch([twin], options=drafts[0])
    ct = DistCotrainer(policy, drafts, Grid(), make_policy_opt, observers=[timer, watch])
    st = ct.step(make_batch(policy), grpo("global-token"), micro_batches=2)
    # the trained drafts' metrics are taken in their forward, before their optimizer step: the twin's equal them
    assert st["observed_metrics"][0] == st["draft_metrics"][0]
    assert st["observed_metrics"][0] != st["draft_metrics"][1]  # the other (differently seeded) draft: a difference
    assert all(torch.equal(v, before[k]) for k, v in twin.state_dict().items())
    assert all(p.grad is None for p in twin.parameters())  # forward only
    # the hook's time holds the watched arms' reads; one process: the reduced means are this process's own seconds
    assert st["hook_seconds"] > st["watch_seconds"] > 0
    assert (st["hook_cpu_seconds"], st["watch_cpu_seconds"]) == (timer.own_cpu, watch.own_cpu)
    assert watch.collect(True, 1) == ({}, {"watch_seconds": 0.0, "watch_cpu_seconds": 0.0})  # the step took them


def test_an_update_without_the_drafts_reads_no_watched_arm():
    policy, drafts = make_models()
    watch = DraftWatch([copy.deepcopy(drafts[0].draft)])
    st = DistCotrainer(policy, drafts, Grid(), make_policy_opt, observers=[HookTimer(), watch]).step(
        make_batch(policy), grpo("global-token"), micro_batches=2, train_drafts=False)
    assert st["observed_metrics"] == [None] and st["watch_seconds"] == 0.0 and st["hook_seconds"] == 0.0


def test_an_observer_that_is_not_one_is_refused():
    policy, drafts = make_models()
    with pytest.raises(TypeError, match="observers: got Eagle3Draft; expected StepObserver instances"):
        DistCotrainer(policy, drafts, Grid(), make_policy_opt, observers=(drafts[1].draft,))
