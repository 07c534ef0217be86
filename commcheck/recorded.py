"""Traces recorded from whole train.py runs under gloo, kept as files and replayed on nccl_check's model of NCCL.

A run's trace is one file per rank, OUT/rank<r>.json.gz: the rank's events (comm_trace.py's format) as JSON lists.
They come from tests/comm_record.py, which runs train.py under torchrun with every torch.distributed call and every
host sync point logged; commcheck/traces/ keeps one run per draft family (F) and CP size (C: 2, 4), recorded by

    torchrun --standalone --nproc_per_node=$((2 * C)) tests/comm_record.py commcheck/traces/F_pp2_cpC --preset test \
        --pp 2 --cp C --zero1 --dtype bf16 --drafter F --ckpt_every 1 --steps 1 --out RUN --cache_dir EMPTY_DIR

(16-34 s each on 2 cores; tests/test_nccl_real.py replays them, and its slow test records them again to compare).

    python -m commcheck.recorded                     # replay every run in commcheck/traces/ under both wait models
    python -m commcheck.recorded commcheck/traces/dflash_pp2_cp4

What a trace recorded on the CPU stands for on a GPU node: every call is taken as an NCCL call on its group's
communicator. On make_mesh's "cpu:gloo,cuda:nccl" groups a CPU tensor's collective runs on gloo instead (the object
collectives, the cu_seqlens fingerprint): a host-blocking exchange on gloo's own connections, which the model replaces
by an NCCL call followed by a host sync -- more constrained, never less, so a trace that passes here passes there.
"""
from __future__ import annotations

import glob
import gzip
import json
import os

from commcheck.nccl_check import WAITS, simulate

TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces")


def save(path: str, events) -> None:
    """Write one rank's events (comm_trace.py's tuples) as gzipped JSON, byte for byte the same for the same events
    (no time or name in the gzip header)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    text = json.dumps([list(ev) for ev in events], separators=(",", ":")).encode()
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text)


def _event(ev) -> tuple:
    if ev[0] != "call":
        return tuple(ev)
    _, cid, kind, (name, ranks), ops = ev
    return ("call", cid, kind, (name, tuple(ranks)), tuple(tuple(op) for op in ops))


def load(run_dir: str) -> dict:
    """{rank: events} of a recorded run (every rank<r>.json.gz in run_dir)."""
    paths = glob.glob(os.path.join(run_dir, "rank*.json.gz"))
    if not paths:
        raise ValueError(f"run_dir={run_dir!r}: expected rank<r>.json.gz files (tests/comm_record.py writes them)")
    out = {}
    for path in paths:
        with gzip.open(path, "rt") as f:
            out[int(os.path.basename(path)[4:-8])] = [_event(ev) for ev in json.load(f)]
    return dict(sorted(out.items()))


def check(run_dir: str) -> dict:
    """{wait model: simulate's lines} for one recorded run: [] under both means deadlock-free."""
    traces = load(run_dir)
    return {waits: simulate(traces, waits) for waits in WAITS}


def summary(traces: dict) -> dict:
    """What a run's trace holds, summed over ranks: calls by kind, waits, host syncs, and the groups used."""
    calls = [ev for evs in traces.values() for ev in evs if ev[0] == "call"]
    kinds = {}
    for ev in calls:
        kinds[ev[2]] = kinds.get(ev[2], 0) + 1
    events = [ev for evs in traces.values() for ev in evs]
    return {"ranks": len(traces), "calls": kinds, "waits": sum(ev[0] == "wait" for ev in events),
            "host syncs": sum(ev == ("host",) for ev in events),
            "groups": sorted({ev[3][0] for ev in calls})}


if __name__ == "__main__":
    import sys

    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    runs = sys.argv[1:] or sorted(d for d in glob.glob(os.path.join(TRACES, "*")) if os.path.isdir(d))
    for run in runs:
        res, info = check(run), summary(load(run))
        verdict = "; ".join(f"{w} waits: " + ("deadlock-free" if not lines else f"{len(lines)} blocked")
                            for w, lines in res.items())
        print(f"{os.path.basename(run)}: {verdict}  ({info})")
        for line in next((lines for lines in res.values() if lines), [])[:8]:
            print("  " + line)
