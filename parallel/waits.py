"""Bounded point-to-point waits: every wait on a torch.distributed transfer (the pipeline's batches, the CP ring,
TapChannel) ends within --dist_timeout, and a wait that ends badly says which rank waited for what.

    set_timeout(cfg.dist_timeout)          # harness/mesh.py, once, before the grid (grid.py) creates its groups
    wait_all(works, ["pipeline recv of activations for microbatch 3 from stage 0"], backend_of(group, buf))
    # a stopped peer -> WaitTimeout: "rank 2: pipeline recv of activations for microbatch 3 from stage 0 timed out
    #                                  after 20 s (--dist_timeout)"

Two things bound a wait, and both are needed:
  1. the sub-groups' own timeout. init_process_group(timeout=) sets the WORLD group's only: new_group() without a
     timeout gets torch's default (30 min on gloo, 10 min on NCCL), so grid.py passes timeout() to every new_group.
     That bounds the groups' collectives too (a peer of a stopped rank may first wait in one, e.g. the CP group's
     check_same_cu_seqlens): those end in torch's own message, which names no wait.
  2. here, by the backend that runs the transfer: backend_of(group, tensor), the group's backend for the tensor's
     device type. harness/mesh.py creates "cpu:gloo,cuda:nccl" on a GPU node, so a CUDA tensor goes to NCCL and a CPU
     tensor to gloo on the same group; a group made with one name ("nccl", "gloo") runs every device type it can.
     gloo  Work.wait(timeout): the calling thread waits for the transfer for at most `timeout` (counted from the call).
           Past it gloo raises "Timed out waiting Nms for recv (send) operation to complete" and marks every connection
           of the group's context failed: the group is unusable afterwards. A send waits too: gloo sends once the
           receiver has posted its receive. This is what ends the peers of a stopped rank with the wait named.
     NCCL  a plain Work.wait(), no timeout: it only makes the current CUDA stream wait for the transfer, and the CPU
           runs on to launch what follows (a later NCCL call queues behind that wait on the device: its stream waits
           for the current stream's state when it is issued). The bound is NCCL's watchdog: every group was created
           with --dist_timeout (init_process_group and grid.py's new_group), and the watchdog thread aborts a work
           older than that and takes the process down with NCCL's message (the operation's sequence number, not our
           label). Why not Work.wait(timeout) on NCCL: with a timeout the calling CPU thread polls the work until it
           completes (NCCL's "blocking wait"), a spinning core per rank on every ring hop, pipeline batch and
           TapChannel receive, and the CPU no longer runs ahead of the GPU. What blocks the host on NCCL is a host
           sync point (.item(), a copy to the host, a device-wide sync), never one of these waits.
A wait that fails otherwise (a peer that died: "Connection closed by peer") is re-raised as WaitFailed, which names
the rank and the wait too.
"""
from __future__ import annotations

import datetime
import time

import torch
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


def backend_of(group=None, on="cuda") -> str | None:
    """The backend that runs `group`'s work on `on` (a tensor, a torch.device or a device type; group None: the
    default group): "nccl", "gloo", ...; None without a process group, or where the group runs nothing on that device
    type. Read from the group's backend string with torch's own parser, the one that registered the group's backends:
    "cpu:gloo,cuda:nccl" per device type, a single name for every device type it supports ("nccl": cuda only)."""
    if not dist.is_initialized():
        return None
    kind = on.device.type if isinstance(on, torch.Tensor) else torch.device(on).type
    by_device = dist.BackendConfig(dist.get_backend(group)).get_device_backend_map()  # ~5 us: parses a short string
    backend = by_device.get(kind)
    return None if backend is None else str(backend).lower()


def wait_all(works, labels, backend: str | None = None) -> None:
    """Wait for every Work in `works`, all of them together within timeout(). labels: one per work (gloo returns a
    Work per P2POp), or any number when the backend coalesced them (NCCL: one Work for a batch); then the message
    names them all. backend: the works' (backend_of(group, tensor)): NCCL's works are waited without a timeout (the
    stream waits, the CPU does not poll; its watchdog bounds them), every other backend's, and None's (no process
    group, or not known), within timeout()."""
    works, labels = list(works), list(labels)
    stream_wait = backend == "nccl"
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
