"""Ring attention at 8K and 32K tokens on one GPU: bench/bench_attention_gpu.py at cp = 4 (virtual ranks, threads on the
one GPU), bf16, Qwen3-8B's heads (Hq = 32, Hkv = 8, D = 128) with P = 3 branch entries, for the triton backend, flash
where flash-attn imports, and torch (the reference kernel, a Python loop over tiles) at 8K only; then its rows read
back.

The check fails when a backend that loaded has no result at a length (an error, out of memory, or the time budget
ran out) and prints `SKIPPED flash: ...` when flash-attn is not installed (bench/gpu_check.sh counts that line as a
skipped stage, never an ok one).

    python bench/gpu_check_attention.py                  # CUDA: L = 8192, 32768; ~1 min with Triton's compilation
    python bench/gpu_check_attention.py --tiny           # any device: bench_attention_gpu's --quick sizes, torch kernel

Writes bench_attention_gpu's JSON (and its plot) to --out.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(1, BENCH)  # its sibling bench_attention_gpu, however it is run
import bench_attention_gpu  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402


def flash_missing(device: str) -> str:
    """Why flash does not run here ('' when it can)."""
    if device != "cuda":
        return "no CUDA device"
    return "" if importlib.util.find_spec("flash_attn") else "flash-attn is not installed (README: GPUs)"


def bench_args(tiny: bool, out: str, device: str) -> list:
    """bench_attention_gpu's flags for this check. Its --budget_s extrapolates a backend's first size, Triton's
    compilation included, by L^2 and would skip 32K: it is set out of reach, and the stage's limit bounds the run."""
    if tiny:
        return [f"--device={device}", "--quick", "--cp=4", "--backends=torch", f"--out={out}"]
    backends = "torch,triton" + ("" if flash_missing(device) else ",flash")
    return ["--device=cuda", "--lengths=8192,32768", "--cp=4", f"--backends={backends}", "--torch_max_len=8192",
            "--repeats=2", "--budget_s=3600", f"--out={out}"]


def problems(report: dict) -> list:
    """A backend that loaded with no result at a length it was asked for (torch: up to its torch_max_len)."""
    cfg, bad = report["config"], []
    lengths = [int(x) for x in cfg["lengths"].split(",")]
    for backend, status in report["backends"].items():
        if status != "ok":
            bad.append(f"{backend}: {status}")
            continue
        for L in lengths:
            if backend == "torch" and L > cfg["torch_max_len"]:
                continue
            row = next((r for r in report["rows"] if r["L"] == L and r["backend"] == backend), {})
            if "fwd_bwd_ms" not in row:
                bad.append(f"{backend} at L={L}: {row.get('status', 'no row')}")
    return bad


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--tiny", action="store_true", help="bench_attention_gpu --quick with the torch kernel")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "gpu_check_attention.json"), help="JSON path")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bench_attention_gpu.main(bench_args(a.tiny, a.out, device))
    with open(a.out) as f:
        bad = problems(json.load(f))
    if flash_missing(device):
        print(f"SKIPPED flash: {flash_missing(device)}")
    if bad:
        raise SystemExit("; ".join(bad))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
