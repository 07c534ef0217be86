"""The one communication primitive cospec's context parallelism uses: a ring of point-to-point exchanges.

A CP group of `size` ranks exchanges tensors with `Ring.exchange(sends, recvs)`: every transfer starts at once, and
after wait() each buffer holds what its peer sent, for whatever this rank runs next (on NCCL the stream waits and the
host returns at once: parallel/waits.py). Ring attention (attention_cp.py) and the CP-aware shift
(branch_mask.cp_shift) are written against this one call, so the same per-rank code runs

    over torch.distributed   DistRing: batched isend/irecv on a process group (gloo on CPU, NCCL on GPU), and
    over threads             ThreadRing + run_ranks: the ranks of one CP group as threads of one process, which is how
                             the tests and the demos run the real per-rank code without torchrun.

    python -c "from parallel.ring import run_ranks; print(run_ranks(3, lambda r: r.rank))"     # [0, 1, 2]
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from parallel.waits import backend_of, wait_all


# ----------------------------------------------------------------------------------------- the CP communication ring
class Ring:
    """Point-to-point exchange inside one CP group of `size` ranks; this process (or thread) is `rank`.

    exchange(sends=[(dst, tensor)], recvs=[(src, buffer)]) starts every transfer and returns a handle; after
    its wait() each buffer holds what its src sent, for every op this rank issues next. Both sides must list a
    transfer (same shape and dtype) in the same order, as with NCCL/gloo. Everything CP does (ring attention, the
    shift) is built on this one call.
    what: names the exchange in the error of a wait that times out (parallel/waits.py) or fails."""
    rank: int = 0
    size: int = 1

    def exchange(self, sends, recvs, what: str = "ring exchange"):
        if sends or recvs:
            raise RuntimeError("a CP group of size 1 has no peers to exchange with")
        return _Pending([])


class _Pending:
    def __init__(self, waits, keep=None):
        self.waits, self.keep = waits, keep  # keep: the send tensors, alive until the transfer is done

    def wait(self):
        for w in self.waits:
            w()


class _DistPending:  # torch.distributed Works, each labelled for the error message; waited as their backend wants
    def __init__(self, works, labels, keep, backend):
        self.works, self.labels, self.keep, self.backend = works, labels, keep, backend

    def wait(self):  # NCCL: the stream waits, the host runs on; gloo: the host waits, within --dist_timeout
        wait_all(self.works, self.labels, self.backend)


class DistRing(Ring):
    """torch.distributed (gloo on CPU, NCCL on GPU): batched async isend/irecv. P2POp takes *global* ranks."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)

    def exchange(self, sends, recvs, what: str = "ring exchange"):
        peer = lambda r: dist.get_global_rank(self.group, r)  # noqa: E731
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer(dst), self.group) for dst, t in sends]
        ops += [dist.P2POp(dist.irecv, buf, peer(src), self.group) for src, buf in recvs]
        labels = [f"CP {what}: send to rank {peer(dst)}" for dst, _ in sends]
        labels += [f"CP {what}: recv from rank {peer(src)}" for src, _ in recvs]
        backend = backend_of(self.group, ops[0].tensor) if ops else None  # a CUDA tensor on cpu:gloo,cuda:nccl: NCCL
        return _DistPending(dist.batch_isend_irecv(ops) if ops else [], labels, keep=ops, backend=backend)


class ThreadRing(Ring):
    """In-process CP group: rank r is a thread, transfers are per-(src, dst) FIFO queues. Sends are copied at once
    (like a buffered isend); wait() blocks until every expected message is there, and fails fast (instead of hanging)
    if another rank has failed or `timeout` passes. Used by the tests and `run_ranks` to run the real per-rank code."""

    def __init__(self, hub: dict, rank: int, size: int, timeout: float):
        self.hub, self.rank, self.size, self.timeout = hub, rank, size, timeout

    def _box(self, src, dst) -> queue.Queue:
        with self.hub["lock"]:
            return self.hub["boxes"].setdefault((src, dst), queue.Queue())

    def exchange(self, sends, recvs, what: str = "ring exchange"):
        for dst, t in sends:
            self._box(self.rank, dst).put(t.detach().clone())
        return _Pending([lambda src=src, buf=buf: self._take(src, buf) for src, buf in recvs])

    def _take(self, src, buf):
        deadline = time.monotonic() + self.timeout
        while True:
            if self.hub["failed"].is_set():
                raise RuntimeError(f"rank {self.rank}: another rank failed while this one waited on rank {src}")
            try:
                msg = self._box(src, self.rank).get(timeout=0.02)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: nothing from rank {src} after {self.timeout}s")
        if msg.shape != buf.shape or msg.dtype != buf.dtype:
            raise RuntimeError(f"rank {self.rank}: rank {src} sent {tuple(msg.shape)} {msg.dtype}, "
                               f"expected {tuple(buf.shape)} {buf.dtype}")
        buf.copy_(msg)


def run_ranks(size: int, fn, timeout: float = 60.0) -> list:
    """Run fn(ring) for ranks 0..size-1 as threads over one in-process ThreadRing group; return their results.
    A rank's exception is re-raised here (the others stop waiting at once)."""
    hub = {"lock": threading.Lock(), "boxes": {}, "failed": threading.Event(), "first": None}
    results = [None] * size

    def body(r):
        try:
            # CUDA runs autograd's backward on one worker thread per device, shared by every thread that calls
            # backward: rank 0's backward blocking in _take (waiting on rank 1) would stall rank 1's backward queued
            # behind it on that same worker -- a deadlock. Without multithreading each rank's backward runs on its own
            # thread (CPU tensors already do).
            with torch.autograd.set_multithreading_enabled(False):
                results[r] = fn(ThreadRing(hub, r, size, timeout))
        except BaseException as e:  # noqa: BLE001 - the first failure is the cause; re-raised below
            with hub["lock"]:
                hub["first"] = hub["first"] or e
            hub["failed"].set()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            hub["failed"].set()
            raise TimeoutError(f"run_ranks: a rank did not finish within {timeout}s")
    if hub["first"] is not None:
        raise hub["first"]
    return results


def as_ring(group) -> Ring:
    """group=None: no CP (size 1, same code, no communication); a Ring: itself; else a torch ProcessGroup."""
    if group is None:
        return Ring()
    if isinstance(group, Ring):
        return group
    return DistRing(group)
