"""train.py --resume: a run SIGKILLed mid-way and resumed ends with the same metrics as an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _metrics(path):  # every record, without wall-clock fields (timings, tokens/s)
    out = []
    for line in open(path):
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if k != "time" and not k.startswith("speedup") and "tok_s" not in k})
    return out


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    base = [sys.executable, "train.py", "--preset=test", f"--cache_dir={tmp_path / 'cache'}", "--steps=4",
            "--ckpt_every=1", "--device=cpu"]  # CPU determinism (GPU kernels may reorder sums)
    a, b = tmp_path / "a", tmp_path / "b"
    subprocess.run(base + ["--out", str(a)], cwd=ROOT, check=True, timeout=180, capture_output=True)
    p = subprocess.Popen(base + ["--out", str(b)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (b / "ckpt" / "step_000002").is_dir():  # the rename makes it appear complete
        assert p.poll() is None and time.monotonic() < deadline, "run b ended before its step-2 checkpoint"
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    r = subprocess.run(base + ["--out", str(b), "--resume"], cwd=ROOT, timeout=180, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume: from step" in r.stdout
    assert _metrics(b / "metrics.jsonl") == _metrics(a / "metrics.jsonl")
