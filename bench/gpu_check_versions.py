"""What the GPU check runs on: python, torch and its CUDA, each GPU's name and memory, triton, flash_attn, transformers
and tokenizers (a package that is missing is printed as missing, not an error).

    python bench/gpu_check_versions.py                 # fails (exit 1) when CUDA is not available
    python bench/gpu_check_versions.py --device=cpu    # the dry run: no GPU expected

Writes the same facts as JSON to --out (bench/gpu_check.sh: next to its report).
"""
from __future__ import annotations

import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.cli import parser, run_main  # noqa: E402

PACKAGES = ("triton", "flash_attn", "transformers", "tokenizers")


def versions(device: str) -> dict:
    """The facts; device "cuda" with no usable GPU raises SystemExit naming what is missing."""
    out = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda, gpus=[])
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device=cuda: CUDA is not available (torch {torch.__version__}, built for CUDA "
                             f"{torch.version.cuda}); for a dry run: --device=cpu")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append(dict(name=p.name, total_gib=round(p.total_memory / 2**30, 2),
                                    capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count))
    for name in PACKAGES:
        try:
            out[name] = __import__(name).__version__
        except ImportError as e:
            out[name] = f"missing ({e})"
    return out


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the device the check expects")
    ap.add_argument("--out", default="", help="JSON path ('' : none)")
    a = ap.parse_args(argv)
    res = versions(a.device)
    for key, value in res.items():
        if key != "gpus":
            print(f"{key:13s} {value}")
    for i, g in enumerate(res["gpus"]):
        print(f"gpu {i:<9d} {g['name']}, {g['total_gib']} GiB, sm {g['capability']}, {g['multiprocessors']} SMs")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
