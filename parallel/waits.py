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
  2. here, by backend:
     gloo  Work.wait(timeout): the calling thread waits for the transfer for at most `timeout` (counted from the call).
           Past it gloo raises "Timed out waiting Nms for recv (send) operation to complete" and marks every connection
           of the group's context failed: the group is unusable afterwards. A send waits too: gloo sends once the
           receiver has posted its receive. This is what ends the peers of a stopped rank with the wait named.
     NCCL  a plain Work.wait(), no timeout: it only makes the current CUDA stream wait for the transfer, and the CPU
           runs on to launch what follows. The bound is NCCL's watchdog: every group was created with --dist_timeout
           (init_process_group and grid.py's new_group), and the watchdog thread aborts a work older than that and
           takes the process down with NCCL's message (the operation's sequence number, not our label). Why not
           Work.wait(timeout) on NCCL: with a timeout the calling CPU thread polls the work until it completes (NCCL's
           "blocking wait"), a spinning core per rank on every ring hop, pipeline action and TapChannel receive, and
           the CPU no longer runs ahead of the GPU. A stopped peer then shows up within --dist_timeout either way.
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


def _backend() -> str:
    """The default group's backend ("gloo", "nccl"); every group of a run shares it (grid.py). "gloo" without a
    process group (in-process rings), so a wait there stays bounded."""
    return str(dist.get_backend()).lower() if dist.is_initialized() else "gloo"


def wait_all(works, labels, backend: str | None = None) -> None:
    """Wait for every Work in `works`, all of them together within timeout(). labels: one per work (gloo returns a
    Work per P2POp), or any number when the backend coalesced them (NCCL: one Work for a batch); then the message
    names them all. backend: the works' ("gloo", "nccl", ...; None = the default group's): NCCL's works are waited
    without a timeout (the stream waits, the CPU does not poll; its watchdog bounds them), every other backend's
    within timeout()."""
    works, labels = list(works), list(labels)
    stream_wait = (backend or _backend()) == "nccl"
    limit = _timeout[0]
    deadline = time.monotonic() + limit
    for i, w in enumerate(works):
        what = labels[i] if len(labels) == len(works) else ", ".join(labels) or "point-to-point transfer"
        left = max(deadline - time.monotonic(), 0.001)  # timedelta(0) would mean "no timeout"
        try:
            if stream_wait:
                w.wait()  # no CPU-side poll: NCCL's watchdog (group timeout = --dist_timeout) bounds it
            else:
                w.wait(datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise WaitTimeout(f"rank {_rank()}: {what} timed out after {limit:g} s (--dist_timeout)") from e
            raise WaitFailed(f"rank {_rank()}: {what} failed: {text}") from e
