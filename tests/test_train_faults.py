"""Faults stop a run loudly: a NaN/inf loss or diverged weights name the loss (or model) and the step, a diverged
warm-up is never cached, and under torchrun a rank that raises makes the whole job exit non-zero with that rank's error
within a bounded time instead of hanging."""
import math
import os
import subprocess
import sys

import pytest
import torch

from harness.experiment import build
from harness.mesh import make_mesh
from harness.update import check_finite
from harness.config import parse_args
from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINITE = {"loss_policy": 0.1, "loss_draft": 2.0, "grad_norm": 0.5}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):  # the warm-ups are trained once, then loaded: each test builds its own run
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def setup(cache_dir):
    cfg = parse_args(["--preset=test", f"--cache_dir={cache_dir}"])
    return build(cfg, make_mesh(cfg), log=lambda *a, **k: None)


@pytest.mark.parametrize("key, value", [("loss_policy", math.nan), ("loss_draft", math.inf), ("grad_norm", -math.inf)])
def test_a_non_finite_loss_names_itself_and_the_step(setup, key, value):
    check_finite(3, FINITE, setup)  # all finite: passes
    with pytest.raises(FloatingPointError, match=rf"step 7: {key} = {value} \(not finite\); stopping"):
        check_finite(7, {**FINITE, key: value}, setup)


@pytest.mark.parametrize("model", ["policy", "cotrained draft", "cold draft"])
def test_diverged_weights_name_the_model_and_the_step(setup, model):
    m = setup.policy if model == "policy" else setup.drafts[model.split()[0]].draft
    name, p = next(iter(m.named_parameters()))
    keep = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[0] = math.inf
    try:
        with pytest.raises(FloatingPointError, match=rf"step 4: after the update, the {model}: the weights are not "
                                                     rf"finite \({name}\)"):
            check_finite(4, FINITE, setup)
    finally:
        with torch.no_grad():
            p.copy_(keep)


@pytest.mark.parametrize("flag, where", [("--sft_lr=1e30", "SFT warm-up"), ("--draft_warmup_lr=1e30", "draft warm-up")])
def test_a_diverged_warmup_stops_and_caches_nothing(tmp_path, flag, where):
    cache = tmp_path / "cache"
    with pytest.raises(FloatingPointError, match=rf"{where} step \d+: loss = nan \(not finite\)"):
        train(parse_args(["--preset=test", flag, f"--cache_dir={cache}", f"--out={tmp_path / 'run'}"]))
    cached = os.listdir(cache) if cache.exists() else []
    assert not any(n.startswith("draft-" if "draft" in where else "policy-") for n in cached), cached


FAIL_ENTRY = """
import os, sys
sys.path.insert(0, {root!r})
import train
from harness import config
real = train.update
calls = []
def update(s, batch, timer, *step):  # rank 1 raises in its second update; the others block in a collective
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        raise RuntimeError("injected failure on rank 1 at step 2")
    return real(s, batch, timer, *step)
train.update = update
train.train(config.parse_args(sys.argv[1:]))
"""


def test_a_failing_rank_fails_the_whole_torchrun_job(tmp_path):
    entry = tmp_path / "fail_rank.py"
    entry.write_text(FAIL_ENTRY.format(root=ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(entry),
           "--preset=test", "--pp=2", "--cp=1", "--steps=4", "--dist_timeout=60", f"--out={tmp_path / 'run'}",
           f"--cache_dir={tmp_path / 'cache'}"]
    # dist_timeout=60: the surviving rank gives up on its collective after 60 s at most; a hang fails the timeout
    r = subprocess.run(cmd, cwd=ROOT, timeout=240, capture_output=True, text=True)
    assert r.returncode != 0
    assert "injected failure on rank 1 at step 2" in r.stdout + r.stderr  # the failing rank's error is reported
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "train"' in line for line in lines) == 1  # step 1 finished, step 2 never did
