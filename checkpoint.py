"""Atomic, verified checkpoints: a crash at any instant leaves the previous checkpoint or the new one, never half.

Layout: one directory per step. Each rank writes its own file (its pipeline-stage slice of the policy, the draft, the
optimizers, its RNG streams); rank 0 adds the shared metadata and, last of all, the manifest.

    ckpt/step_000120/rank00000.pt    {"states": {"policy": ..., "policy_opt": ..., ...}, "rng": capture_rng(...)}
                     rank00001.pt    the same for rank 1 ({} states for a data-parallel replica; RNG still saved)
                     meta.pt         {"step", "world", "metrics" (list of dicts), "extra" (config)}
                     MANIFEST.json   {"files": {name: {"bytes", "sha256"}}, ...}               written last

Why it is safe:
  1. Every rank writes into `.tmp-step_000120/`, a name no reader takes for a checkpoint, and fsyncs its file.
  2. After a barrier (every rank file is on disk) rank 0 hashes the files, writes MANIFEST.json, fsyncs, and renames the
     directory to `step_000120`. A rename is atomic on POSIX: a reader sees no checkpoint or the whole one.
  3. The manifest catches what the rename cannot: a file truncated or lost afterwards (full disk, an interrupted copy of
     the folder, a rank writing to a disk rank 0 cannot see). `latest_checkpoint` re-checks every size and sha256 and
     skips, with a warning naming the path and the reason, anything that does not match.

Usage (every rank makes the same calls; with one process leave out rank/world/barrier):

    path = latest_checkpoint("out/ckpt")                     # None on a fresh run
    if path is not None:
        c = load_checkpoint(path, rank)
        model.load_state_dict(c["states"]["policy"]); opt.load_state_dict(c["states"]["policy_opt"])
        restore_rng(c["rng"], {"data": data_gen}); start, metrics = c["step"], c["metrics"]
    ...                                                      # after finishing step s (s + 1 steps done):
    save_checkpoint("out/ckpt", s + 1, states={"policy": model.state_dict(), "policy_opt": opt.state_dict()},
                    rng=capture_rng({"data": data_gen}), metrics=metrics, extra=asdict(cfg),
                    rank=rank, world=world, barrier=dist.barrier)

`step` counts finished steps, so a resumed loop runs `range(c["step"], n)`. The folder must be one that every rank sees
(a shared filesystem), and one job writes to it at a time. Files are read with `torch.load(weights_only=False)` because
besides tensors they hold plain Python objects (python/numpy RNG states, the config) that the weights-only unpickler
rejects; pickle can run code, so load only checkpoints you wrote: the sha256 guards against corruption, not tampering.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

FORMAT = "cospec-checkpoint/1"
MANIFEST, META, TMP = "MANIFEST.json", "meta.pt", ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# ---- random streams ----

def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every stream a step may draw from: torch CPU, CUDA (all visible devices), python, numpy, and named generators."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(), "numpy": np.random.get_state(),
            "generators": {name: g.get_state() for name, g in (generators or {}).items()}}


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Put every stream back where `capture_rng` found it: the next draws continue the saved sequence."""
    generators = generators or {}
    if set(generators) != set(state["generators"]):
        raise ValueError(f"generator names differ: saved {sorted(state['generators'])}, given {sorted(generators)}")
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    elif state["cuda"] is not None:
        warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available: they are not restored")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    for name, g in generators.items():
        g.set_state(state["generators"][name])


# ---- files ----

def _write(path: Path, dump: Callable) -> None:
    """Write `path` durably: dump into `path.part`, fsync, rename. A crash leaves a .part file, never a short `path`."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        dump(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a rename inside `path` survives a power cut only once `path` itself is fsynced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<n>` directory in `folder`, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


# ---- save ----

def save_checkpoint(folder, step: int, *, states: dict[str, dict], rng: dict, metrics: list | None = None,
                    extra: dict | None = None, rank: int = 0, world: int = 1,
                    barrier: Callable[[], None] | None = None, keep_last: int | None = 3) -> Path:
    """Write this rank's part of checkpoint `step` in `folder`; return its path once it is complete for every rank.

    Collective when world > 1: all `world` ranks call it and `barrier()` must synchronise them (e.g. dist.barrier).
    states: the state dicts this rank alone holds, by name ({} for a replica); rng: this rank's `capture_rng(...)`;
    metrics, extra: taken from rank 0. keep_last: complete checkpoints kept, this one included (None: keep all).
    If one rank raises in here the others wait at the next barrier: the process group's timeout bounds that wait.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not in range(world={world})")
    if world > 1 and barrier is None:
        raise ValueError("world > 1 needs a barrier that synchronises every rank (e.g. torch.distributed.barrier)")
    if step < 0 or (keep_last is not None and keep_last < 1):
        raise ValueError(f"need step >= 0 and keep_last >= 1 or None, got step={step}, keep_last={keep_last}")
    barrier = barrier or (lambda: None)
    folder = Path(folder)
    final = folder / f"step_{step:06d}"
    tmp = folder / (TMP + final.name)  # the same name on every rank, so no rank needs to be told it
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(TMP + "*"):  # one job per folder: a temp dir is a crashed save's or prune's leftover
            shutil.rmtree(stale)
        tmp.mkdir()
    barrier()  # sync 1: the empty temp dir exists before anyone writes into it
    _write(tmp / rank_file(rank), lambda f: torch.save({"states": states, "rng": rng}, f))
    if rank == 0:
        meta = {"step": step, "world": world, "metrics": list(metrics or []), "extra": dict(extra or {})}
        _write(tmp / META, lambda f: torch.save(meta, f))
    barrier()  # sync 2: every rank's file is on disk
    if rank == 0:
        names = [META] + [rank_file(r) for r in range(world)]
        missing = [n for n in names if not (tmp / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{tmp} lacks {missing}: is {folder} on a filesystem that every rank shares?")
        # hidden cost: rank 0 reads every shard back to hash it -- the bytes on disk, not the ones a rank meant to write
        files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in names}
        manifest = {"format": FORMAT, "step": step, "world": world, "files": files}
        _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(tmp)
        if final.exists():  # an older save of this step, from a run that later resumed from an earlier checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit: from here on readers see the whole checkpoint
        _fsync_dir(folder)
    barrier()  # sync 3: no rank goes on (to resume, or to save again) before the commit
    if rank == 0 and keep_last is not None:
        _prune(folder, step, keep_last)
    return final


def _prune(folder: Path, step: int, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest `keep_last` up to `step`; the new one is always kept.

    Directories of later steps (left by a run that resumed from an earlier checkpoint) are not touched here: the save
    that reaches their step replaces them.
    """
    older = [p for s, p in _step_dirs(folder) if s < step and (p / MANIFEST).is_file()]  # newest first
    for p in older[keep_last - 1:]:
        trash = p.with_name(TMP + "prune-" + p.name)
        os.replace(p, trash)  # vanish atomically first: a crash mid-delete leaves a temp dir, not a broken checkpoint
        shutil.rmtree(trash)


# ---- find and load ----

def _manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest["format"] != FORMAT or not isinstance(manifest["files"], dict):
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable {MANIFEST} ({type(e).__name__}: {e})") from e
    return manifest


def _problem(path: Path) -> str | None:
    """Why `path` is not a complete, intact checkpoint; None if it is one."""
    if not (path / MANIFEST).is_file():
        return f"no {MANIFEST} (the save never finished)"
    try:
        files = _manifest(path)["files"]
    except ValueError as e:
        return str(e)
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)"
        if _sha256(p) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def latest_checkpoint(folder) -> Path | None:
    """The newest checkpoint in `folder` whose every file matches its manifest; None if there is none.

    Partial or damaged ones are skipped with a warning naming the path and the reason. Cost: each candidate's files are
    read in full (hashed) until one passes.
    """
    folder = Path(folder)
    for stale in sorted(folder.glob(TMP + "*")) if folder.is_dir() else []:
        warnings.warn(f"ignoring {stale}: temporary directory left by an interrupted save", stacklevel=2)
    for _, path in _step_dirs(folder):
        problem = _problem(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
    return None


def _read(path: Path, name: str, manifest: dict, map_location):
    if name not in manifest["files"]:
        raise ValueError(f"{path}: the manifest lists no {name}")
    if not (path / name).is_file():
        raise FileNotFoundError(f"{path / name} is missing (the manifest lists it)")
    data = (path / name).read_bytes()  # hash the very bytes we unpickle, in one read
    if hashlib.sha256(data).hexdigest() != manifest["files"][name]["sha256"]:
        raise ValueError(f"{path / name} does not match its sha256 in the manifest (corrupt)")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)  # why: module docstring


def load_checkpoint(path, rank: int = 0, *, map_location="cpu") -> dict:
    """Rank `rank`'s part of the checkpoint at `path`: {"step", "world", "states", "rng", "metrics", "extra", "path"}.

    Each file read is checked against the manifest first; a mismatch here is an error (this checkpoint was asked for).
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        why = "no such directory" if not path.is_dir() else f"no {MANIFEST}; find one with latest_checkpoint(folder)"
        raise FileNotFoundError(f"{path} is not a checkpoint ({why})")
    manifest = _manifest(path)
    world = manifest["world"]
    if not 0 <= rank < world:
        raise ValueError(f"{path} was saved by {world} rank(s) and has no file for rank {rank}: "
                         f"resume with the same world size and mesh")
    meta = _read(path, META, manifest, map_location)
    mine = _read(path, rank_file(rank), manifest, map_location)
    return {"step": meta["step"], "world": world, "states": mine["states"], "rng": mine["rng"],
            "metrics": meta["metrics"], "extra": meta["extra"], "path": path}
