"""bench/gpu_smoke.sh's stages at tiny size on the CPU, so that the script a first GPU run starts with cannot rot:
SMOKE_DEVICE=cpu, 1 process, V = 2000, backends "torch flash", drafters eagle3 and dflash (the block family's MASK token
in the checkpoint's tokenizer). Every stage must run and pass (the numerical stage runs
the torch kernel's fp32 / bf16 checks against fp64 in place of the CUDA-only tests; the HF-mode run's summary has
kl_last null, which the summary check must accept), flash must be counted skipped (not ok: no CUDA here), the stage
limits must add up to <= 10 minutes, and the report must hold every stage. Adds ~40 s on 2 cores, ~90 s under a load
average of 20 (the training run with activation checkpointing ~20 s, the checkpoint ~6 s).
"""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_stages_run_on_cpu(tmp_path):
    report = tmp_path / "report.md"
    env = dict(os.environ, SMOKE_DEVICE="cpu", SMOKE_NPROC="1", SMOKE_VOCAB="2000", SMOKE_BACKENDS="torch flash",
               SMOKE_WORK=str(tmp_path / "work"), SMOKE_REPORT=str(report), OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", "bench/gpu_smoke.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-2000:]
    total = int(re.search(r"stage limits add up to (\d+) s", out).group(1))
    assert total <= 600, f"the stage limits add up to {total} s > 10 minutes"
    for name in ("versions", "numerical tests", "random Qwen3 checkpoint", "train, torchrun x1",
                 "summary of the torch eagle3 run", "summary of the torch dflash run"):
        assert re.search(rf"^\[{re.escape(name)}[^\]]*\] ok in \d+s$", out, re.M), f"stage {name!r} not ok:\n{out}"
    assert re.search(r"^\[train, --attn_backend=flash\] skipped: flash-attn is not installed", out, re.M), out
    assert re.search(r"^stages: 7 ok, 1 skipped, 0 failed$", out, re.M), out
    text = report.read_text()
    assert text.count("\n## ") == 7 and "kl_last" in text and "null allowed: ['kl_last']" in text, text[-3000:]
