"""End to end under torchrun: `--preset smoke` on a 4-process gloo mesh (pp = 2, cp = 2) finishes and writes a sane
summary. Slow (~2-3 min on 2 cores: the warm-ups dominate), so it is one test with a hard timeout."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_under_torchrun_pp2_cp2(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "train.py",
           "--preset=smoke", f"--out={out}", f"--cache_dir={tmp_path / 'cache'}"]
    r = subprocess.run(cmd, cwd=ROOT, timeout=420, capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    s = json.loads((out / "summary.json").read_text())
    for key in ("steps", "reward_first", "reward_last", "kl_last", "accept_len_cotrained", "accept_len_frozen",
                "rollout_speedup", "wall_s"):
        assert key in s and math.isfinite(s[key]), (key, s.get(key))
    assert s["steps"] == 8
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 8
    assert s["accept_len_cotrained"] > 1.5 and s["accept_len_frozen"] > 1.5  # the drafts really draft
    assert s["accept_len_cotrained"] >= s["accept_len_frozen"]  # co-training does not fall behind the frozen copy
    assert s["kl_last"] > 0  # the policy moved
