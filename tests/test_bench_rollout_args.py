"""bench/bench_rollout.py's flags: every value is checked before anything is trained (a wrong clock on a GPU would
time the host, not the device)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_rollout  # noqa: E402


def test_clock_follows_the_device():
    assert bench_rollout.parse_args([]).clock == "cpu"  # auto on the CPU: the process's CPU time
    assert bench_rollout.parse_args(["--clock=wall"]).clock == "wall"
    assert bench_rollout.parse_args(["--trees=2,1:3,1", "--batches=1,8"]).batches == (1, 8)
    assert bench_rollout.repeat_factors(bench_rollout.parse_args(["--repeat_scale=1:3"]).repeat_scale) == {1: 3}
    assert bench_rollout.repeat_factors(bench_rollout.parse_args(["--repeat_scale="]).repeat_scale) == {}


@pytest.mark.parametrize("argv,match", [
    (["--clock=gpu"], "--clock"),
    (["--repeats=x"], "--repeats"),
    (["--no_such_key=1"], "bad argument"),
    (["--device=tpu"], "--device"),
    (["--repeat_scale=1x4"], "--repeat_scale"),
    (["--repeat_scale=1:0"], "--repeat_scale"),
])
def test_bad_flags_are_refused(argv, match):
    with pytest.raises(SystemExit, match=match):
        bench_rollout.parse_args(argv)


def test_device_flag():
    """Without CUDA --device=cuda is refused; with it the clock becomes the synchronized wall clock and the CPU clock
    is refused."""
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA GPU"):
            bench_rollout.parse_args(["--device=cuda"])
        return
    assert bench_rollout.parse_args(["--device=cuda"]).clock == "wall"
    with pytest.raises(SystemExit, match="wall on a GPU"):
        bench_rollout.parse_args(["--device=cuda", "--clock=cpu"])


def test_auto_targets_pair_the_repeats():
    """The auto row against the best fixed chain of its (batch, tau): the spread is that of the per-repeat difference,
    so machine noise shared by both columns cancels (here auto - best is 0.1 below in every repeat: sd 0, a miss)."""
    from bench_rollout import auto_targets
    row = lambda k, sp, rep: dict(batch=8, temperature=1.0, k=k, tree=[], speedup=sp, speedup_per_repeat=rep,  # noqa
                                  speedup_sd=0.5, auto=dict(steps_at_k=[1, 0, 9], k_mode=2, k_mean=1.8, alpha=[0.9]))
    t = auto_targets([row(2, 1.5, [1.0, 2.0]), row(4, 1.2, [0.9, 1.5]), row("auto", 1.4, [0.9, 1.9])])
    (r,) = t["rows"]
    assert (r["best_k"], r["diff_sd"], r["vs_best_ok"], r["vs_ar_ok"]) == (2, 0.0, False, True)
    assert t["geomean_auto"] == 1.4 and t["geomean_best_fixed"] == 1.5 and not t["geomean_ok"]


def test_the_held_out_best_fixed_k_is_not_picked_by_its_own_noise():
    """Column A is 1.0 on even repeats and 2.0 on odd ones, B 1.5 throughout. Picked on the even half, B (1.5) is
    scored on the odd half: 1.5; picked on the odd half, A (2.0) is scored on the even half: 1.0. The held-out best is
    their mean, 1.25, where the in-sample best (A's median, 1.5, or any max over columns) would credit A's luck."""
    from bench_rollout import heldout_best
    a = dict(speedup=1.5, speedup_per_repeat=[1.0, 2.0] * 4)
    b = dict(speedup=1.5, speedup_per_repeat=[1.5] * 8)
    assert heldout_best([a, b]) == 1.25
    assert heldout_best([dict(speedup=1.3, speedup_per_repeat=[1.0, 2.0])]) == 1.3  # < 4 repeats: the in-sample one
