"""Bounded point-to-point waits: every wait on a torch.distributed transfer (the pipeline's batches, the CP ring,
TapChannel) ends within --dist_timeout, and a wait that ends badly says which rank waited for what.

    set_timeout(cfg.dist_timeout)          # harness/mesh.py, once, before the grid (grid.py) creates its groups
    wait_all(works, ["pipeline recv of activations for microbatch 3 from stage 0"])
    # a stopped peer -> WaitTimeout: "rank 2: pipeline recv of activations for microbatch 3 from stage 0 timed out
    #                                  after 20 s (--dist_timeout)"

Two things bound a wait, and both are needed:
  1. the sub-groups' own timeout. init_process_group(timeout=) sets the WORLD group's only: new_group() without a
     timeout gets torch's default (30 min on gloo, 10 min on NCCL), so grid.py passes timeout() to every new_group.
     That bounds the groups' collectives too (a peer of a stopped rank may first wait in one, e.g. the CP group's
     check_same_cu_seqlens): those end in torch's own message, which names no wait.
  2. Work.wait(timeout) here, which names the wait. What it does:
     gloo  the calling thread waits for the transfer for at most `timeout` (counted from the call). Past it gloo raises
           "Timed out waiting Nms for recv (send) operation to complete" and marks every connection of the group's
           context failed: the group is unusable afterwards. A send waits too: gloo sends once the receiver has posted
           its receive. Without a timeout, wait() waits the group's timeout (1. above).
     NCCL  wait() alone only makes the current CUDA stream wait for the transfer: the CPU runs on and a stopped peer
           shows up at the next host sync, or when the watchdog thread finds the work older than the group's timeout.
           With a timeout the CPU thread polls the work until it completes or `timeout` has passed since the work was
           issued; then it aborts the work's NCCL communicator (ncclCommAbort: its pending and later operations fail)
           and raises DistBackendError ("... timed out in blocking wait"), which becomes WaitTimeout here. The
           watchdog checks the same deadline (the group's timeout is --dist_timeout too) and may act first: then NCCL
           takes the process down with its own message, naming the operation's sequence number, not the wait. Either
           way the job ends within --dist_timeout. Cost: the CPU no longer runs ahead of a wait (the kernels after it
           are launched once the transfer is done), a launch latency per hop.
A wait that fails otherwise (a peer that died: "Connection closed by peer") is re-raised as WaitFailed, which names
the rank and the wait too.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

DEFAULT_S = 1800.0  # torch's default group timeout on gloo, and --dist_timeout's default
_timeout = [DEFAULT_S]


class WaitFailed(RuntimeError):
    """A point-to-point wait that failed; the message (one line) names the rank and the wait."""


class WaitTimeout(WaitFailed):
    """A point-to-point wait that outlived --dist_timeout."""


def set_timeout(seconds: float) -> None:
    """The bound of every wait that follows and of the groups grid.Grid.build creates from now on (seconds > 0)."""
    if not seconds > 0:
        raise ValueError(f"dist_timeout={seconds}: expected > 0 seconds")
    _timeout[0] = float(seconds)


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=_timeout[0])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def wait_all(works, labels) -> None:
    """Wait for every Work in `works`, all of them together within timeout(). labels: one per work (gloo returns a
    Work per P2POp), or any number when the backend coalesced them (NCCL: one Work for a batch); then the message
    names them all."""
    works, labels = list(works), list(labels)
    limit = _timeout[0]
    deadline = time.monotonic() + limit
    for i, w in enumerate(works):
        what = labels[i] if len(labels) == len(works) else ", ".join(labels) or "point-to-point transfer"
        left = max(deadline - time.monotonic(), 0.001)  # timedelta(0) would mean "no timeout"
        try:
            w.wait(datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise WaitTimeout(f"rank {_rank()}: {what} timed out after {limit:g} s (--dist_timeout)") from e
            raise WaitFailed(f"rank {_rank()}: {what} failed: {text}") from e
