"""A multi-rank start whose rank 0 builds longer than --dist_timeout ends in one clear line per rank, not a traceback.

2 gloo processes with torchrun's env contract run train.py (its own __main__: the one-line error handling) at
--dist_timeout 3, with harness.experiment.build_models patched to sleep 12 s on rank 0 before building: rank 1 waits
at the build barrier past the timeout (on the CPU rank 0 trains the warm-ups alone first) and must exit non-zero with
a line naming itself, the phase and rank 0; rank 0 then finds its peer gone and must exit non-zero with one line too.
Adds ~35 s on 2 cores (two processes importing torch, the 3 s timeout, rank 0's 12 s sleep and its tiny build).
"""
import os
import re
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S, SLEEP_S, LIMIT_S = 3, 12, 150

DRIVER = """
import os, runpy, sys, time
sys.path.insert(0, {root!r})
import torch
import harness.experiment as experiment
torch.set_num_threads(1)
build_models = experiment.build_models

def slow(*a, **k):  # rank 0's build, slower than --dist_timeout (every rank builds, the warm-ups together)
    if os.environ["RANK"] == "0":
        time.sleep({sleep})
    return build_models(*a, **k)

experiment.build_models = slow
sys.argv = ["train.py", "--preset=test", "--pp=1", "--cp=1", "--dp=2", "--micro_batches=2", "--steps=1",
            "--dist_timeout={timeout}", "--cache_dir={cache}", "--out={out}", "--overwrite"]
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_slow_rank0_build_ends_in_one_line_per_rank(tmp_path):
    entry = tmp_path / "driver.py"
    entry.write_text(DRIVER.format(root=ROOT, sleep=SLEEP_S, timeout=TIMEOUT_S, cache=str(tmp_path / "cache"),
                                   out=str(tmp_path / "out")))
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(entry)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    t0 = time.monotonic()
    try:
        outs = [p.communicate(timeout=LIMIT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert time.monotonic() - t0 < LIMIT_S
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, (r, out, err)
        assert "Traceback" not in err, f"rank {r} ended in a traceback:\n{err[-3000:]}"
        lines = [l for l in err.splitlines() if l.startswith("train.py: ")]
        assert len(lines) == 1, (r, err[-3000:])
        assert re.search(rf"^train.py: rank {r}: build: .*rank\(s\) {1 - r} .*--dist_timeout", lines[0]), lines[0]
