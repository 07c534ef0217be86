"""The watched arms (harness/watch.py's DraftWatch) ride the update's draft hook: a watched draft is read from the same
taps, teacher and loss options as the trained drafts, forward only, and its time is reported apart from theirs.
One process, fp64, the 1 x 1 x 1 grid (tests/test_dist_step.py runs the step on 4 gloo ranks). ~4 s on 2 cores."""
import copy

import pytest
import torch

from dist_step import DistCotrainer
from harness.watch import DraftWatch
from parallel.grid import Grid
from test_dist_step import grpo, make_batch, make_models, make_policy_opt


def test_a_watched_copy_reads_what_the_trained_draft_reads_and_stays_untouched():
    policy, drafts = make_models()
    twin = copy.deepcopy(drafts[0].draft)  # the rollout draft as it is before the step
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    watch = DraftWatch([twin], options=drafts[0])
    ct = DistCotrainer(policy, drafts, Grid(), make_policy_opt, watch=watch)
    st = ct.step(make_batch(policy), grpo("global-token"), micro_batches=2)
    # the trained drafts' metrics are taken in their forward, before their optimizer step: the twin's equal them
    assert st["watch_metrics"][0] == st["draft_metrics"][0]
    assert st["watch_metrics"][0] != st["draft_metrics"][1]  # the other (differently seeded) draft: a real difference
    assert all(torch.equal(v, before[k]) for k, v in twin.state_dict().items())
    assert all(p.grad is None for p in twin.parameters())  # forward only
    # its time is measured apart: the drafts' share excludes it; one process: own CPU seconds = the step's
    assert st["watch_seconds"] > 0 and st["draft_seconds"] > 0
    assert st["own_cpu_seconds"] == (st["draft_cpu_seconds"], st["watch_cpu_seconds"])
    assert watch.take() == ({}, 0.0, 0.0)  # the step took the reads: the next one starts afresh


def test_an_update_without_the_drafts_reads_no_watched_arm():
    policy, drafts = make_models()
    watch = DraftWatch([copy.deepcopy(drafts[0].draft)])
    st = DistCotrainer(policy, drafts, Grid(), make_policy_opt, watch=watch).step(
        make_batch(policy), grpo("global-token"), micro_batches=2, train_drafts=False)
    assert st["watch_metrics"] == [None] and st["watch_seconds"] == 0.0


def test_a_watch_that_is_not_an_observer_is_refused():
    policy, drafts = make_models()
    with pytest.raises(TypeError, match="watch: got a tuple; expected None or an observer"):
        DistCotrainer(policy, drafts, Grid(), make_policy_opt, watch=(drafts[1].draft,))
