"""Two runs of train.py, field by field: is the behaviour the same? Timings aside, every field of metrics.jsonl and of
summary.json must be equal (or, with --rtol, agree to that relative tolerance).

A field is a timing when its name says so: `time`, tok/s, seconds, speedups (measured from tok/s) and the wall time;
`warmup_cached` differs between a run that trained its warm-ups and one that loaded them. The rest -- rewards,
acceptance, losses, gradient norms, KL, the weights' fingerprints -- is the run's behaviour.

    python bench/compare_runs.py runs/before runs/after            # exit 0: the same; 1: lists every difference
    python bench/compare_runs.py runs/before runs/after --rtol 1e-6
"""
from __future__ import annotations

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time", "tok_s", "seconds", "speedup", "wall_s", "time_s", "warmup_cached", "e2e_step_s", "_s_ar", "_s_spec")


def timing(key: str) -> bool:
    return any(t in key for t in TIMING)


def differences(a, b, rtol: float, where: str) -> list:
    """Every place where a and b differ beyond rtol (nested dicts and lists), timing keys skipped."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted((set(a) | set(b)) - {k for k in set(a) | set(b) if timing(k)})
        return [d for k in keys for d in differences(a.get(k), b.get(k), rtol, f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, rtol, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and rtol > 0:
        same = math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) or (math.isnan(a) and math.isnan(b))
    else:
        same = a == b
    return [] if same else [f"{where}: {a!r} vs {b!r}"]


def load(run: str) -> tuple:
    for name in ("metrics.jsonl", "summary.json"):
        if not os.path.isfile(os.path.join(run, name)):
            raise ValueError(f"{run!r} holds no {name}: expected a finished run's --out directory")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(run, "summary.json")) as f:
        return records, json.load(f)


def main(argv=None) -> int:
    from parallel.cli import parser
    ap = parser(__doc__, __file__)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of floats (default: 0, bit-equal)")
    args = ap.parse_args(argv)
    (ra, sa), (rb, sb) = load(args.before), load(args.after)
    diffs = [] if len(ra) == len(rb) else [f"metrics.jsonl: {len(ra)} records vs {len(rb)}"]
    for i, (x, y) in enumerate(zip(ra, rb)):
        diffs += differences(x, y, args.rtol, f"metrics.jsonl[{i}] ({x.get('kind')} @ {x.get('step')})")
    diffs += differences(sa, sb, args.rtol, "summary.json")
    n = sum(len(r) for r in ra) + len(sa)
    if diffs:
        print(f"{len(diffs)} fields differ:\n  " + "\n  ".join(diffs))
        return 1
    print(f"the same: {len(ra)} records and the summary ({n} top-level fields, timings aside)"
          f"{f' within rtol {args.rtol}' if args.rtol else ', bit-equal'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
