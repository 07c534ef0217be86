"""What the once-per-step cu_seqlens check (consistency.check_same_cu_seqlens) costs, over gloo CPU processes.

Per step every CP rank hashes the step's micro-batch boundaries (S + 1 ints each) into one int64 and all_gathers it.
Timed: the hash alone, and hash + all_gather + compare (mean over `--reps` calls, max over ranks). On a shared 2-core
machine the collective's time is mostly scheduling noise: read it as an upper bound next to a training step (seconds).

    python bench/bench_consistency.py            # ~30 s; prints a table, writes bench/results/consistency.json
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from dist_util import run_distributed  # noqa: E402
from parallel.cli import parser  # noqa: E402


def _worker(rank, world, n_seqs, n_mb, reps):
    import torch.distributed as dist

    from parallel.consistency import check_same_cu_seqlens, fingerprint
    cus = [torch.arange(0, 8 * (n_seqs + 1), 8, dtype=torch.int32) for _ in range(n_mb)]
    check_same_cu_seqlens(cus, dist.group.WORLD)  # warm-up: the gloo connections
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fingerprint(cus)
    t_hash = (time.perf_counter() - t) / reps
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        check_same_cu_seqlens(cus, dist.group.WORLD)
    return t_hash, (time.perf_counter() - t) / reps


def main():
    ap = parser(__doc__, __file__)
    ap.add_argument("--reps", type=int, default=300, help="timed calls per measurement (default: %(default)s)")
    args = ap.parse_args()
    rows = []
    print(f"{'cp':>3} {'S':>5} {'mb':>3} {'hash us':>8} {'check us':>9}")
    for world in (2, 4):
        for n_seqs, n_mb in ((64, 2), (1024, 8)):
            r = run_distributed(_worker, world, args=(n_seqs, n_mb, args.reps), timeout=300)
            row = {"cp": world, "seqs": n_seqs, "micro_batches": n_mb, "hash_us": max(x[0] for x in r) * 1e6,
                   "check_us": max(x[1] for x in r) * 1e6}
            rows.append(row)
            print(f"{world:3d} {n_seqs:5d} {n_mb:3d} {row['hash_us']:8.0f} {row['check_us']:9.0f}")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "consistency.json"), "w") as f:
        json.dump({"machine": "gloo, processes sharing 2 CPU cores", "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
