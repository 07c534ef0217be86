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


@pytest.mark.parametrize("argv,match", [
    (["--clock=gpu"], "--clock"),
    (["--repeats=x"], "--repeats"),
    (["--no_such_key=1"], "bad argument"),
    (["--device=tpu"], "--device"),
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
