"""Counts, on the CPU, the operations that would make a GPU wait for its host (or the host for the GPU), so that a test
can hold a code path to a budget of host syncs without a GPU.

On a GPU these ops cannot be enqueued and forgotten: the host needs a value, or an output size, that only the device
knows, so it blocks until the stream has caught up (and the stream then idles until the host enqueues more):

    _local_scalar_dense      .item(), int(t), float(t), bool(t) (an `if t:`), f"{t:.2f}", t used as a Python index;
                             also torch.equal / allclose (a bool to the host)
    nonzero                  also torch.where(mask) with one argument, argwhere
    masked_select            x.masked_select(mask)
    index / index_put_       with a boolean (or uint8) mask among the indices: x[mask], x[mask] = v
    repeat_interleave        with tensor repeats and no output_size
    unique                   _unique2, unique_dim, unique_consecutive
    tolist / numpy           a device-to-host copy of the values (these two never reach the dispatcher on a CPU
                             tensor, so the counter wraps the Tensor methods while it is active)

A TorchDispatchMode sees each op once, as the dispatcher runs it (what an op does inside its own kernel is not seen
again), in the thread that entered the mode: ranks simulated by threads (parallel.ring.run_ranks) each enter their own.
Under torch.inference_mode (tensors without autograd keys) composite ops reach the mode whole, before they decompose:
hence item, is_nonzero, where(condition) and nonzero_numpy beside the ops they become.

    with HostSyncs() as syncs:
        ...                                  # the code under budget
    assert syncs.count <= 3, syncs.sites     # sites: "op  file:line in function" of each sync
"""
from __future__ import annotations

import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose,  # a value to the host
           aten.nonzero, aten.nonzero_numpy, aten.argwhere, aten.masked_select,  # an output size to the host
           aten._unique2, aten._unique, aten.unique_dim, aten.unique_consecutive}
_READS = ("tolist", "numpy")  # Tensor methods that copy values to the host without an op on a CPU tensor
_patch_lock, _patched = threading.Lock(), [0, {}]  # (active counters, saved methods)


def syncing_op(func, args, kwargs) -> str | None:
    """The name of the sync if the op `func`(args, kwargs) makes the host wait for the device, else None."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return packet.__name__
    if func is aten.where.default:  # torch.where(condition): nonzero
        return "where(condition)"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
            return f"{packet.__name__} with a boolean mask"
    tensor_repeats = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
    if func in tensor_repeats and kwargs.get("output_size") is None:  # output_size is keyword-only: in kwargs
        return "repeat_interleave without output_size"
    return None


def _site() -> tuple:
    """(innermost frame of the caller's code as "file:line in function" (not torch's, not this file's), the names of
    every function on the stack). Walks the frames without reading source lines (fast)."""
    here, names, f = None, set(), sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if "/torch/" not in path and not path.endswith("sync_count.py"):
            if here is None:
                here = f"{path.rsplit('/', 1)[-1]}:{f.f_lineno} in {f.f_code.co_name}"
            names.add(f.f_code.co_name)
        f = f.f_back
    return here or "?", frozenset(names)


class HostSyncs(TorchDispatchMode):
    """Counts host syncs (module docstring) in the thread that entered it; .sites lists them, .count their number."""

    def __init__(self):
        super().__init__()
        self.sites, self.stacks = [], []  # "op  file:line in function"; the function names on the stack of each

    @property
    def count(self) -> int:
        return len(self.sites)

    def _add(self, name):
        here, names = _site()
        self.sites.append(f"{name}  {here}")
        self.stacks.append(names)

    def outside(self, *functions) -> list:
        """The sites of the syncs made with none of `functions` (names) on the stack."""
        return [s for s, names in zip(self.sites, self.stacks) if not names.intersection(functions)]

    def by_op(self) -> dict:
        out = {}
        for s in self.sites:
            op = s.split("  ")[0]
            out[op] = out.get(op, 0) + 1
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = syncing_op(func, args, kwargs)
        if name is not None:
            self._add(name)
        return func(*args, **kwargs)

    def __enter__(self):
        with _patch_lock:
            if _patched[0] == 0:
                _patched[1] = {n: getattr(torch.Tensor, n) for n in _READS}
                for n, fn in _patched[1].items():
                    setattr(torch.Tensor, n, _counted_read(n, fn))
            _patched[0] += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with _patch_lock:
                _patched[0] -= 1
                if _patched[0] == 0:
                    for n, fn in _patched[1].items():
                        setattr(torch.Tensor, n, fn)


def _counted_read(name, fn):
    def read(t, *args, **kw):
        mode = _get_current_dispatch_mode()
        if isinstance(mode, HostSyncs):
            mode._add(name)
        return fn(t, *args, **kw)
    return read
