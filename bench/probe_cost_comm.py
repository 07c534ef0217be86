"""The communication figures of harness/cost_model.py, measured on THIS machine with real gloo processes (never a run):

    python bench/probe_cost_comm.py --out bench/results/cost_device_cpu_quiet.json   # ~10 s: o_comm, BW_comm into it

  o_comm    wall seconds of one exchange between ring neighbours (batch_isend_irecv: a send to rank + 1 and a receive
            from rank - 1, as the context ring's hops and the pipeline's sends are issued) of a 4-byte tensor: the
            backend's latency and its host work per operation
  BW_comm   bytes/s of the same exchange carrying --mib MiB each way, past o_comm: (t_big - t_tiny) / bytes sent

--procs processes (default: 2 x cores, as the default run's 4 ranks share 2 cores), one thread each, niceness --nice,
each exchanging with its neighbours --repeats times per round; a figure is the median over rounds of the slowest
rank's mean (an exchange completes when both peers are there). Wall seconds, unlike the compute figures (CPU
seconds): an exchange waits on its peer, and a peer that is not running must first be scheduled. So the figures hold
for that process count, and the cost model applies no contention factor to them: on this 2-core VM a 4-byte exchange
took ~0.3 ms between 2 processes and ~1.7-2.0 ms between 4 (more than the 2.6x the compute's contention factor would
give).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from parallel.cli import parser  # noqa: E402


def _exchange_s(rank: int, n: int, numel: int, repeats: int) -> float:
    """Mean wall seconds of one ring exchange of `numel` fp32 values each way (after 3 warm-up exchanges)."""
    send, recv = torch.ones(numel), torch.empty(numel)

    def once():
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for _ in range(3):
        once()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - t0) / repeats


def _worker(rank, n, store, nice, numels, repeats, rounds, q):
    torch.set_num_threads(1)
    try:
        os.nice(nice)
    except (PermissionError, OSError):
        pass
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n)
    try:
        q.put((rank, (os.nice(0), [[_exchange_s(rank, n, m, repeats) for m in numels] for _ in range(rounds)])))
    finally:
        dist.destroy_process_group()


def probe(procs: int, mib: float, repeats: int, rounds: int, nice: int) -> dict:
    """{o_comm, BW_comm, per-round timings} from `procs` spawned gloo processes."""
    big = int(mib * 2 ** 20 / 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ps = [ctx.Process(target=_worker, args=(r, procs, os.path.join(tmp, "store"), nice, (1, big), repeats,
                                                 rounds, q), daemon=True) for r in range(procs)]
        for p in ps:
            p.start()
        got = dict(q.get(timeout=600) for _ in ps)
        for p in ps:
            p.join(timeout=10)
    niceness = max(v[0] for v in got.values())  # what the processes got (raising priority needs the right)
    got = {r: v[1] for r, v in got.items()}
    slowest = [[max(got[r][i][j] for r in got) for j in range(2)] for i in range(rounds)]  # per round: tiny, big
    tiny = statistics.median(s[0] for s in slowest)
    per_byte = statistics.median((s[1] - s[0]) / (4 * big) for s in slowest)
    return {"o_comm": tiny, "BW_comm": 1.0 / per_byte if per_byte > 0 else 0.0, "niceness": niceness,
            "rounds": [[round(x * 1e3, 4) for x in s] for s in slowest]}


def main(argv=None):
    ap = parser(__doc__, __file__)
    ap.add_argument("--out", required=True, help="an existing device file (bench/probe_cost.py writes one): o_comm "
                    "and BW_comm are written into it, the other figures kept")
    ap.add_argument("--procs", type=int, default=0, help="gloo processes (0: 2 x cores, the default run's ranks)")
    ap.add_argument("--mib", type=float, default=2.0, help="MiB each way of the large exchange")
    ap.add_argument("--repeats", type=int, default=50, help="exchanges per round and size")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (the figure: the median round)")
    ap.add_argument("--nice", type=int, default=-20, help="niceness of the probe's processes")
    a = ap.parse_args(argv)
    if not os.path.isfile(a.out):
        raise SystemExit(f"--out {a.out}: expected an existing device file to update")
    for name in ("repeats", "rounds", "mib"):
        if getattr(a, name) <= 0:
            raise SystemExit(f"--{name}={getattr(a, name)}: expected > 0")
    procs = a.procs or 2 * len(os.sched_getaffinity(0))
    if procs < 2:
        raise SystemExit(f"--procs={procs}: expected >= 2 (an exchange needs a peer)")
    with open(a.out) as f:
        dev = json.load(f)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    res = probe(procs, a.mib, a.repeats, a.rounds, a.nice)
    dev.setdefault("overheads", {})["o_comm"] = res["o_comm"]
    dev["BW_comm"] = res["BW_comm"]
    dev["source"] = dev.get("source", "").split("; o_comm, BW_comm by")[0] + (
        f"; o_comm, BW_comm by python bench/probe_cost_comm.py --procs {procs} --mib {a.mib:g} --repeats {a.repeats} "
        f"--rounds {a.rounds} (wall seconds, the slowest rank per round, ms per exchange [4 B, {a.mib:g} MiB]: "
        f"{res['rounds']}; niceness {res['niceness']}, {time.perf_counter() - t0:.0f} s wall, load average "
        f"{load0:.2f} at the start and "
        f"{os.getloadavg()[0]:.2f} at the end)")
    with open(a.out, "w") as f:
        json.dump(dev, f, indent=1)
    print(f"o_comm {res['o_comm'] * 1e3:.3f} ms, BW_comm {res['BW_comm'] / 1e9:.3f} GB/s (rounds, ms: "
          f"{res['rounds']}) -> {a.out}")
    return 0


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
