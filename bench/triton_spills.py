"""Register spills of attention_triton's kernels at their default launch settings, without a GPU: each kernel is
compiled for sm_90a by Triton (to PTX) and assembled by the ptxas that ships with Triton, whose -v report gives the
registers per thread and the bytes spilled to local memory. A spill costs a round trip to L1/L2 on every use inside
the inner loop; the defaults in TritonBlocks.config are chosen so that none of these reports one.

    python bench/triton_spills.py                    # bf16, D = 64, 128, 256: bench/results/triton_spills.{md,json}
    python bench/triton_spills.py --dims=256 --search "bwd dkdv"     # every candidate setting of one kernel
    python bench/triton_spills.py --dims=128 --dtype=fp16

Letters: D head dim, BD its power-of-2 bucket, BM / BN / BR tile rows.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from backends import attention_triton as at  # noqa: E402
from backends import attention_triton_kernels as K  # noqa: E402
from parallel.cli import parser  # noqa: E402

FP32_ARGS = {"Out", "Lse", "Delta", "dQ", "dK", "dV", "dBK", "dBV", "dO"}  # the fp32 accumulators (and dout)
INPUT_ARGS = {"Q", "K", "V", "BK", "BV"}


def signature(kernel, dtype: str) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in INPUT_ARGS:
            sig[name] = f"*{dtype}"
        elif name in FP32_ARGS:
            sig[name] = "*fp32"
        elif name == "Tiles":
            sig[name] = "*i32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name in ("BM", "BN", "BD", "BR", "PRECISION"):
            continue
        else:
            sig[name] = "i32"
    return sig


def ptxas_report(kernel, dtype: str, constexprs: dict, opts: dict) -> dict:
    """Compile one kernel to PTX for sm_90a and assemble it with ptxas -v: registers and spill bytes per thread."""
    src = ASTSource(fn=kernel, signature=signature(kernel, dtype), constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90a (the bundled one that reads its PTX version)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return {"registers": int(regs.group(1)) if regs else None, "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0}


def launches(D: int, dtype: torch.dtype) -> list:
    """(name, kernel, constexprs, options) of every kernel at TritonBlocks' defaults for head dim D."""
    cfg = at.TritonBlocks().config(torch.empty(1, 1, D, dtype=dtype))
    const = cfg["const"]
    (fm, fn), fo = cfg["fwd"]
    (qm, qn), qo = cfg["dq"]
    (ko, ki), kop = cfg["dkdv"]
    br, bo = cfg["branch"]
    brc = dict(BR=br, BD=const["BD"])
    return [("fwd", K._fwd_kernel, dict(BM=fm, BN=fn, **const), fo, f"{fm}x{fn}"),
            ("bwd dq", K._bwd_dq_kernel, dict(BM=qm, BN=qn, **const), qo, f"{qm}x{qn}"),
            ("bwd dkdv", K._bwd_dkdv_kernel, dict(BM=ki, BN=ko, **const), kop, f"{ko}x{ki}"),
            ("branch fwd", K._branch_fwd_kernel, brc, bo, f"BR={br}"),
            ("branch bwd dq", K._branch_bwd_dq_kernel, brc, bo, f"BR={br}"),
            ("branch bwd dkv", K._branch_bwd_dkv_kernel, brc, bo, f"BR={br}")]


CANDIDATES = {  # (tiles, num_warps) tried by --search; num_stages as in TritonBlocks.config
    "fwd": [((128, 64), 8), ((128, 32), 8), ((64, 64), 4), ((64, 64), 8), ((64, 32), 4), ((64, 32), 8), ((32, 32), 4),
            ((32, 32), 8), ((32, 16), 4), ((16, 16), 4)],
    "bwd dq": [((128, 32), 8), ((64, 64), 8), ((64, 32), 4), ((64, 32), 8), ((32, 32), 4), ((32, 32), 8), ((32, 16), 4),
               ((32, 16), 8), ((16, 16), 4)],
    "bwd dkdv": [((128, 32), 8), ((64, 64), 8), ((64, 32), 4), ((64, 32), 8), ((32, 32), 4), ((32, 32), 8),
                 ((32, 16), 4), ((32, 16), 8), ((16, 16), 4)],
    "branch": [(br, w) for br in (64, 32, 16) for w in (4, 8)],
}


def search(D: int, dtype: torch.dtype, name: str):
    """Every candidate setting of one kernel family at head dim D: [(tiles, warps, report)]."""
    const = at.TritonBlocks().config(torch.empty(1, 1, D, dtype=dtype))["const"]
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    out = []
    only = os.environ.get("SPILL_CANDIDATES")  # e.g. "32x32w8,16x16w4": a subset of the candidates
    for tiles, w in CANDIDATES["branch" if name.startswith("branch") else name]:
        tag = (f"{tiles[0]}x{tiles[1]}" if isinstance(tiles, tuple) else str(tiles)) + f"w{w}"
        if only and tag not in only.split(","):
            continue
        if name == "fwd":
            kern, c, o = K._fwd_kernel, dict(BM=tiles[0], BN=tiles[1], **const), dict(num_warps=w, num_stages=3)
        elif name == "bwd dq":
            kern, c, o = K._bwd_dq_kernel, dict(BM=tiles[0], BN=tiles[1], **const), dict(num_warps=w, num_stages=2)
        elif name == "bwd dkdv":  # tiles = (outer key rows, inner query rows)
            kern, c, o = K._bwd_dkdv_kernel, dict(BM=tiles[1], BN=tiles[0], **const), dict(num_warps=w, num_stages=2)
        else:
            kern = {"branch fwd": K._branch_fwd_kernel, "branch bwd dq": K._branch_bwd_dq_kernel,
                    "branch bwd dkv": K._branch_bwd_dkv_kernel}[name]
            c, o = dict(BR=tiles, BD=const["BD"]), dict(num_warps=w)
        out.append((tiles, w, ptxas_report(kern, dt, c, o)))
        print(f"  D={D} {name} {tiles} w{w}: {out[-1][2]}", flush=True)
    return out


def main():
    ap = parser(__doc__, __file__)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--search", default="", help="kernel names (fwd, 'bwd dq', 'bwd dkdv', 'branch fwd', ...), "
                                                 "comma-separated: try every candidate setting instead")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "triton_spills.json"))
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.search:
        for D in (int(x) for x in args.dims.split(",")):
            for name in args.search.split(","):
                search(D, dtype, name)
        return
    rows = []
    lines = [f"Triton {triton.__version__}, sm_90a, {args.dtype}: `python bench/triton_spills.py`", "",
             "| D | kernel | tiles | warps | registers | spill stores B | spill loads B |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for D in (int(x) for x in args.dims.split(",")):
        for name, kernel, const, opts, tiles in launches(D, dtype):
            rep = ptxas_report(kernel, args.dtype, const, opts)
            rows.append(dict(D=D, kernel=name, tiles=tiles, num_warps=opts.get("num_warps", 4), **rep))
            lines.append(f"| {D} | {name} | {tiles} | {rows[-1]['num_warps']} | {rep['registers']} | "
                         f"{rep['spill_stores']} | {rep['spill_loads']} |")
            print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"dtype": args.dtype, "target": "sm_90a", "triton": triton.__version__, "rows": rows}, f, indent=1)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
