"""bench/gpu_check.sh's dry run: every stage at tiny size on the CPU (CHECK_DEVICE=cpu: gloo, the torch kernels,
V = 2000), so that the script a lent GPU runs cannot rot. Every stage must pass, flash must be counted skipped (never
ok: no CUDA here), the headline line must be printed, the report must hold each stage's command and output, each
stage's JSON must lie beside it (the update's ratio exactly 1 for every family), and the committed GPU log must stay
untouched. Also: the stage limits add up to <= 10 minutes, as the header says, and the NCCL stage's group string is
harness/mesh.make_mesh's. Adds ~40 s on 2 cores (measured: 40-45 s at a load average of 2-4; the anchor kernels in
Triton's interpreter ~9 s, the HF-mode torchrun ~7 s, the two train.py runs ~4 s each).
"""
import inspect
import json
import os
import re
import subprocess
import sys

from test_layout import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
STAGES = ("versions", "NCCL waits", "LM head", "kernels vs fp64", "one update per family", "ring attention",
          "rollouts per family", "end to end: co-trained speculative run", "end to end: plain GRPO run",
          "end to end: step speedup", "HF mode: random Qwen3 checkpoint", "HF mode: torchrun x1",
          "HF mode: the run's summary")


def limits() -> dict:
    """The script's LIMIT table: stage key -> seconds."""
    text = open(SCRIPT).read()
    table = re.search(r"declare -A LIMIT=\((.*?)\)\n", text, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table)}


def test_the_stage_limits_add_up_to_ten_minutes_as_the_header_says():
    total = sum(limits().values())
    stated = re.search(r"^#.* add up to (\d+) s", open(SCRIPT).read(), re.M)  # the header's first statement
    assert len(limits()) == len(STAGES) and total <= 600, (limits(), total)
    assert stated and int(stated.group(1)) == total, f"the header says {stated and stated.group(1)}; LIMIT sums {total}"


def test_the_waits_stage_creates_the_runs_composite_group():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check_waits
    from harness.mesh import make_mesh
    assert f'"{gpu_check_waits.COMPOSITE}"' in inspect.getsource(make_mesh)


def test_the_dry_run_passes_every_stage_on_the_cpu(tmp_path):
    committed = os.path.join(ROOT, "bench", "results", "gpu_check.md")
    before = os.stat(committed).st_mtime_ns if os.path.exists(committed) else None
    env = dict(os.environ, CHECK_DEVICE="cpu", CHECK_WORK=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("CHECK_REPORT", None), env.pop("CHECK_STAGES", None)
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-2000:]
    assert re.search(rf"^stage limits add up to {sum(limits().values())} s$", out, re.M), out
    for name in STAGES:
        assert re.search(rf"^\[{re.escape(name)}[^\]]*\] ok in \d+s$", out, re.M), f"stage {name!r} not ok:\n{out}"
    assert re.search(r"^\[ring attention\] skipped: flash: no CUDA device$", out, re.M), out
    assert re.search(r"^==> END-TO-END RL STEP SPEEDUP, .* \d+\.\d\dx of wall time \[95% CI", out, re.M), out
    assert out.splitlines()[-2:] == [f"stages: {len(STAGES)} ok, 1 skipped, 0 failed",
                                     f"report: {tmp_path}/gpu_check.md"], out[-500:]
    text = (tmp_path / "gpu_check.md").read_text()
    sections = re.findall(r"^## (.*): ok \(\d+ s of its \d+\)\n\n```\n\$ (python .*)$", text, re.M)
    assert [s for s, _ in sections] == [re.search(rf"^\[({re.escape(n)}[^\]]*)\]", out, re.M).group(1)
                                        for n in STAGES], sections
    for name in ("versions", "waits", "lm_head", "update", "attention", "rollout", "e2e"):
        assert (tmp_path / f"gpu_check_{name}.json").is_file(), name
    update = json.loads((tmp_path / "gpu_check_update.json").read_text())
    assert [f["measured"]["ratio"] for f in update["families"].values()] == [1.0, 1.0, 1.0], update
    assert json.loads((tmp_path / "gpu_check_waits.json").read_text())["group_backend"] == "gloo"
    assert (os.stat(committed).st_mtime_ns if os.path.exists(committed) else None) == before
