"""bench/gpu_smoke.sh runs bench/gpu_check.sh with its arguments and environment (tests/test_gpu_check.py runs the whole
dry run), and a dry run leaves the committed GPU logs alone: CHECK_DEVICE=cpu CHECK_STAGES=1 through gpu_smoke.sh runs
the versions stage, counts the 12 others skipped and writes its report into CHECK_WORK, while
bench/results/gpu_smoke.md (the log of the one run on an H200) and bench/results/gpu_check.md keep their bytes. ~3 s.
"""
import hashlib
import os
import re
import subprocess

from test_layout import ROOT

LOGS = [os.path.join(ROOT, "bench", "results", name) for name in ("gpu_smoke.md", "gpu_check.md")]


def digests() -> list:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None for p in LOGS]


def test_the_smoke_script_runs_the_check_and_a_dry_run_writes_no_gpu_log(tmp_path):
    before = digests()
    env = dict(os.environ, CHECK_DEVICE="cpu", CHECK_STAGES="1", CHECK_WORK=str(tmp_path))
    env.pop("CHECK_REPORT", None)
    r = subprocess.run(["bash", "bench/gpu_smoke.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-2000:]
    assert re.search(r"^\[versions\] ok in \d+s$", out, re.M), out
    assert re.search(r'^\[NCCL waits\] skipped: stage 2 is not in CHECK_STAGES="1"$', out, re.M), out
    assert out.splitlines()[-2:] == ["stages: 1 ok, 12 skipped, 0 failed", f"report: {tmp_path}/gpu_check.md"], out
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check, dry run on the CPU")
    assert digests() == before, "a dry run wrote over a committed GPU log"
