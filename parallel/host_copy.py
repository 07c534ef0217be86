"""A host copy of a small integer tensor (packed boundaries cu_seqlens, anchor rows), kept on the tensor itself.

The ring steps, tiles and shifts loop in Python over these boundaries, on every layer and ring step of a forward and
backward. Reading a device tensor to the host makes the host wait for the GPU (a host sync), so each tensor is read
once and its copy rides along on the tensor object, keyed by the tensor's version (an in-place change re-reads it).
A tensor built from another's host copy (moved to a device, divided, padded) gets its copy attached at no cost.
"""
from __future__ import annotations

import torch


def host_cu(t: torch.Tensor) -> tuple:
    """t (1-D integer tensor) as a tuple of Python ints: read once per tensor (a host sync for a device tensor)."""
    cached = getattr(t, "_cospec_host", None)
    if cached is not None and cached[0] == t._version:
        return cached[1]
    host = tuple(int(c) for c in t.tolist())  # sync point (device tensors): once per tensor
    with_host_copy(t, host)
    return host


def with_host_copy(t: torch.Tensor, host: tuple) -> torch.Tensor:
    """t with `host` (its values as Python ints) attached as its host copy; returns t."""
    t._cospec_host = (t._version, tuple(host))
    return t


def cu_to(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`, carrying its host copy so that no later step reads it back."""
    return with_host_copy(t.to(device), host_cu(t))
