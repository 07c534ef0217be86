"""Run a function on N real gloo processes from a test, with a hard timeout that fails instead of hanging.

    results = run_distributed(fn, world_size=4, args=(...,), timeout=60)   # fn(rank, world_size, *args) -> picklable

Each process gets torch.distributed initialised (gloo, a FileStore in a fresh temp dir, so concurrent test runs never
collide on a port) and one intra-op thread (N processes share 2 cores). A rank that raises makes the call raise with
that rank's traceback; a rank that hangs makes it raise TimeoutError after `timeout` seconds and kills every rank.
"""
from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, q):
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            q.put((rank, "ok", _by_value(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, including assertion errors, to the parent
        q.put((rank, "error", traceback.format_exc()))


def _by_value(result) -> bytes:
    """Results cross the process boundary as bytes: torch's queue would share tensors through file descriptors that
    vanish when the worker exits."""
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def run_distributed(fn, world_size: int, args=(), timeout: float = 60.0):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world_size, os.path.join(tmp, "store"), fn, args, q),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, []
        try:
            import time
            deadline = time.monotonic() + timeout
            while len(results) + len(errors) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"run_distributed: {world_size - len(results) - len(errors)} rank(s) did not "
                                       f"finish within {timeout}s (errors so far: {errors})")
                try:
                    rank, status, payload = q.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and q.empty():
                        raise RuntimeError(f"run_distributed: rank(s) {dead} died (exit codes "
                                           f"{[procs[i].exitcode for i in dead]}); errors: {errors}")
                    continue
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)  # our own worker's bytes
                else:
                    errors.append(f"rank {rank}:\n{payload}")
                    break  # one failure is enough: the others may now wait forever on it
            if errors:
                raise RuntimeError("run_distributed: a rank failed\n" + "\n".join(errors))
        finally:
            for p in procs:
                p.join(timeout=0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world_size)]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TELLING = ("error", "terminate", "what()", "fatal python", "traceback", "signal", "exception", "file \"")


def run_torchrun(argv, nproc: int, timeout: float):
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc *argv` from the checkout's root, captured,
    with a hard timeout (subprocess.TimeoutExpired: a hang fails). Each worker runs with PYTHONFAULTHANDLER=1, so a
    worker that dies of a signal (a C++ abort) prints every thread's Python stack into the captured stderr."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, argv)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True, env=env)


def why(r) -> str:
    """A failed run's story for an assertion message: the stderr lines that say what went wrong (errors, aborts,
    tracebacks), then the tails of stdout and stderr."""
    lines = r.stderr.splitlines()
    telling = [line for line in lines if any(w in line.lower() for w in _TELLING)]
    return "\n".join([f"exit code {r.returncode}", "-- telling stderr lines:", *telling[-60:],
                      "-- stdout tail:", r.stdout[-1500:], "-- stderr tail:", r.stderr[-2500:]])
