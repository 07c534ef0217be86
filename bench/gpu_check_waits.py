"""NCCL waits on one GPU: the backend the run's composite process group reports, the backend parallel.waits decides for
a CUDA tensor on it, and what one wait costs the host on each of the two paths of waits.wait_all.

    the run's group   harness/mesh.make_mesh creates "cpu:gloo,cuda:nccl" on a GPU node ("gloo" on the CPU)
    backend_of        waits.backend_of(group, tensor): "nccl" for a CUDA tensor, "gloo" for a CPU one
    stream wait       wait_all(works, labels, "nccl") -> Work.wait(): the current CUDA stream waits for the work and
                      the host returns at once
    polling wait      wait_all(works, labels, None) -> Work.wait(timeout): on NCCL the host thread polls the work until
                      it completes, sleeping 1 ms between polls (torch's ProcessGroupNCCL, kSynchronizeBusyWaitMillis)

Each timed wait follows a kernel that keeps the device busy for --busy_ms (torch.cuda._sleep) and an async all_reduce
queued behind it, so the work is pending when the host waits. Expected on CUDA: the stream wait costs the host
microseconds (it returns while the device is still busy), the polling wait at least the device's remaining busy time,
and so at least one poll interval; the check fails otherwise, or when the group or backend_of names another backend.
The process group is a world of 1 (a FileStore in a temporary directory). On CUDA it also prints the device memory
NCCL took outside torch's allocator once its communicator exists (mem_get_info; a world of 1 has no peers, so this is
a floor of what memory_model.NCCL_GIB_PER_GROUP plans per communicator at real world sizes).

    python bench/gpu_check_waits.py                  # CUDA: NCCL, 50 waits of each kind behind 5 ms of device work
    python bench/gpu_check_waits.py --device=cpu     # gloo alone (the dry run): no stream, both paths are host waits

Prints a table; writes JSON to --out (bench/gpu_check.sh: next to its report).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel import waits  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402

COMPOSITE = "cpu:gloo,cuda:nccl"  # harness/mesh.make_mesh's backend string on a GPU node (tests/test_gpu_check.py)


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for `ms` milliseconds, measured with CUDA events."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # the first launch loads the kernel: not timed
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def host_waits(x: torch.Tensor, backend, n: int, busy: int) -> list:
    """Host microseconds of n waits through waits.wait_all with `backend` (the path it picks), each on an all_reduce
    queued behind `busy` cycles of device work (0: none, the CPU)."""
    out = []
    for i in range(n):
        if busy:
            torch.cuda._sleep(busy)  # the device stays busy: the all_reduce below is still pending at the wait
        work = dist.all_reduce(x, async_op=True)
        t0 = time.perf_counter()
        waits.wait_all([work], [f"all_reduce {i}"], backend)
        out.append((time.perf_counter() - t0) * 1e6)
        if x.is_cuda:
            torch.cuda.synchronize()  # outside the timing: the next wait starts from an idle device
    return out


def check(device: str, n: int, busy_ms: float) -> dict:
    """Init the world of 1, read the backends, time both paths; the results (checks not applied yet)."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(COMPOSITE if cuda else "gloo", store=dist.FileStore(os.path.join(d, "store"), 1),
                                rank=0, world_size=1, timeout=waits.timeout())
        try:
            x = torch.ones(1024, device=dev)
            res = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                       group_backend=str(dist.get_backend()), backend_of_device_tensor=waits.backend_of(None, x),
                       backend_of_cpu_tensor=waits.backend_of(None, "cpu"), waits=n)
            free0 = torch.cuda.mem_get_info()[0] if cuda else 0
            reserved0 = torch.cuda.memory_reserved() if cuda else 0
            dist.all_reduce(x)  # NCCL creates its communicator at the first collective
            if cuda:
                torch.cuda.synchronize()
                outside = free0 - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - reserved0)
                res["nccl_outside_allocator_mib"] = round(outside / 2**20, 1)
            busy = sleep_cycles(busy_ms) if cuda else 0
            res["busy_ms"] = busy_ms if cuda else 0.0
            for path, backend in (("as_run", res["backend_of_device_tensor"]), ("with_timeout", None)):
                us = host_waits(x, backend, n, busy)  # as_run: the path backend_of picks, what every run takes
                res[path] = dict(median_us=round(statistics.median(us), 1), max_us=round(max(us), 1),
                                 backend=backend, wait="Work.wait()" if backend == "nccl" else "Work.wait(timeout)")
        finally:
            dist.destroy_process_group()
    return res


def problems(res: dict, device: str) -> list:
    """What the results must show, each a sentence naming what was seen instead."""
    bad = []
    want = (COMPOSITE, "nccl") if device == "cuda" else ("gloo", "gloo")
    if (res["group_backend"], res["backend_of_device_tensor"]) != want:
        bad.append(f"the group reports {res['group_backend']!r} and backend_of picks "
                   f"{res['backend_of_device_tensor']!r} for a {device} tensor; expected {want[0]!r} and {want[1]!r}")
    if res["backend_of_cpu_tensor"] != "gloo":
        bad.append(f"backend_of picks {res['backend_of_cpu_tensor']!r} for a CPU tensor; expected 'gloo'")
    if device == "cuda":
        busy_us = 1e3 * res["busy_ms"]
        if not res["as_run"]["median_us"] < 0.1 * busy_us:
            bad.append(f"the stream wait holds the host {res['as_run']['median_us']} us (median); expected < "
                       f"{0.1 * busy_us:g} us, a tenth of the device's {res['busy_ms']} ms of pending work")
        if not res["with_timeout"]["median_us"] >= max(0.5 * busy_us, 1000.0):
            bad.append(f"the polling wait holds the host {res['with_timeout']['median_us']} us (median); expected >= "
                       f"{max(0.5 * busy_us, 1000.0):g} us (the pending work, at least one 1 ms poll)")
    return bad


def table(res: dict) -> str:
    rows = [f"group backend (harness/mesh.make_mesh's string): {res['group_backend']}",
            f"waits.backend_of(group, {res['device']} tensor) = {res['backend_of_device_tensor']}; "
            f"(group, cpu tensor) = {res['backend_of_cpu_tensor']}",
            f"host time per wait, {res['waits']} waits each, every all_reduce queued behind {res['busy_ms']} ms of "
            f"device work:"]
    for path in ("as_run", "with_timeout"):
        r = res[path]
        rows.append(f"  {'wait_all(backend=%r)' % r['backend']:26s} {r['wait']:19s} median {r['median_us']:9.1f} us"
                    f"   max {r['max_us']:9.1f} us")
    if "nccl_outside_allocator_mib" in res:
        rows.append(f"NCCL's device memory outside torch's allocator at world size 1: "
                    f"{res['nccl_outside_allocator_mib']} MiB")
    return "\n".join(rows)


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL under the composite group")
    ap.add_argument("--waits", type=int, default=50, help="timed waits per path")
    ap.add_argument("--busy_ms", type=float, default=5.0, help="device work queued before each all_reduce (CUDA)")
    ap.add_argument("--out", default="", help="JSON path ('': none)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda: CUDA is not available; for a dry run: --device=cpu")
    if a.waits < 1 or not a.busy_ms > 0:
        raise SystemExit(f"--waits={a.waits}, --busy_ms={a.busy_ms}: expected >= 1 and > 0")
    res = check(a.device, a.waits, a.busy_ms)
    res["problems"] = problems(res, a.device)
    print(table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if res["problems"]:
        raise SystemExit("; ".join(res["problems"]))
    print("ok: " + ("the stream wait returns while the work is pending; the polling wait holds the host until it "
                    "completes" if a.device == "cuda" else "gloo for CPU tensors (no stream: both are host waits)"))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
