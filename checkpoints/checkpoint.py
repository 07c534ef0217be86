"""Atomic, verified, safe checkpoints, and the policy that lets a run resume only itself.

Layout: one directory per step. Each rank writes its own file (its pipeline-stage slice of the policy, the draft, the
optimizers, its RNG streams); rank 0 adds the shared metadata and, last of all, the manifest.

    ckpt/step_000120/rank00000.pt    {"states": {"policy": ..., "policy_opt": ..., ...}, "rng": capture_rng(...)}
                     rank00001.pt    the same for rank 1 ({} states for a data-parallel replica; RNG still saved)
                     meta.pt         {"step", "world", "metrics" (list of dicts), "extra"}
                     MANIFEST.json   {"files": {name: {"bytes", "sha256"}}, "mesh": {"pp", "cp", "dp"}, "config",
                                      "code": {"version", "commit"}, ...}                          written last

Why it is safe against crashes:
  1. Every rank writes into `.tmp-step_000120/`, a name no reader takes for a checkpoint, and fsyncs its file.
  2. Each rank reads its own file back and writes its digest (size, sha256) beside it; after a barrier (every rank
     file and digest on disk) rank 0 gathers the digests into MANIFEST.json, fsyncs, and renames the directory to
     `step_000120`. A rename is atomic on POSIX: a reader sees no checkpoint or the whole one.
  3. The manifest catches what the rename cannot: a file truncated or lost afterwards (full disk, an interrupted copy of
     the folder, a rank writing to a disk rank 0 cannot see). `latest_checkpoint` re-checks every size and sha256 and
     skips, with a warning naming the path and the reason, anything that does not match.
Why loading runs no code: every file is read with `torch.load(weights_only=True)`, which unpickles tensors and plain
values only (numbers, strings, lists, tuples, dicts) and refuses any other global (torch >= 2.6: up to 2.5.1 the
weights-only unpickler could be bypassed, CVE-2025-32434). So a checkpoint holds nothing else: the numpy RNG state is
stored as a tensor, numpy scalars in the metrics become Python numbers, and save refuses anything the safe loader
would refuse, naming where it sits. The sha256 guards against corruption; weights_only against tampering.

Usage (every rank makes the same calls; with one process leave out rank/world/barrier):

    path = latest_checkpoint("out/ckpt")                     # None on a fresh run
    if path is not None:
        c = load_checkpoint(path, rank)
        model.load_state_dict(c["states"]["policy"]); opt.load_state_dict(c["states"]["policy_opt"])
        restore_rng(c["rng"], {"data": data_gen}); start, metrics = c["step"], c["metrics"]
    ...                                                      # after finishing step s (s + 1 steps done):
    save_checkpoint("out/ckpt", s + 1, states={"policy": model.state_dict(), "policy_opt": opt.state_dict()},
                    rng=capture_rng({"data": data_gen}), metrics=metrics, config=asdict(cfg), mesh=(pp, cp, dp),
                    rank=rank, world=world, barrier=dist.barrier)

`step` counts finished steps, so a resumed loop runs `range(c["step"], n)`. The folder must be one that every rank sees
(a shared filesystem), and one job writes to it at a time. A save of step s deletes every checkpoint of a later step:
those belong to another history (an older run, or a continuation this run abandoned by resuming from an earlier step),
and a later resume must never pick them up.

The run-directory policy (resume_policy.py) builds on this file: a fresh run refuses a folder that holds checkpoints,
--resume refuses a checkpoint of another config or mesh and fails when there is none.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import warnings
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from parallel.cli import writing

FORMAT = "cospec-checkpoint/2"  # /2: weights_only-safe files, mesh + config + code version in the manifest
MANIFEST, META, TMP = "MANIFEST.json", "meta.pt", ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# ---- random streams ----

def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every stream a step may draw from: torch CPU, CUDA (all visible devices), python, numpy, and named generators."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(), "numpy": _numpy_state(),
            "generators": {name: g.get_state() for name, g in (generators or {}).items()}}


def _numpy_state() -> dict:
    """numpy's global stream with its key as a tensor: an ndarray would need numpy globals in the safe loader."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


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
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    for name, g in generators.items():
        g.set_state(state["generators"][name])


# ---- files ----

def _write(path: Path, dump: Callable) -> None:
    """Write `path` durably: dump into `path.part`, fsync, rename. A crash leaves a .part file, never a short `path`."""
    part = path.with_name(path.name + ".part")
    with writing(str(path)), open(part, "wb") as f:  # a full disk: an OSError naming the file
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


DIGEST = ".digest.json"  # beside each file of a save in progress: {"bytes", "sha256"} of the bytes on disk


def _write_digest(tmp: Path, name: str) -> None:
    """The digest of tmp/name as read back from disk (not the bytes its writer meant to write), written beside it."""
    d = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    _write(tmp / (name + DIGEST), lambda f: f.write(json.dumps(d).encode()))


def _read_digest(tmp: Path, name: str) -> dict:
    """A file's digest, removed once read; its size checked again (a file cut short after its writer hashed it)."""
    path = tmp / (name + DIGEST)
    d = json.loads(path.read_text())
    path.unlink()
    if d["bytes"] != (tmp / name).stat().st_size:
        raise OSError(f"{tmp / name}: {(tmp / name).stat().st_size} bytes on disk, {d['bytes']} when its rank wrote it")
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<n>` directory in `folder`, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


# ---- what a checkpoint may hold ----

_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.Size, torch.dtype, torch.device)


def plain(x, where: str = "value"):
    """`x` with numpy scalars turned into Python numbers; TypeError naming `where` for anything the safe loader
    (torch.load(weights_only=True)) would refuse. Walks the containers only: tensors are neither copied nor read."""
    if isinstance(x, np.generic):  # before the leaves: np.float64 is a float, but pickles as a numpy global
        return x.item()
    if isinstance(x, _LEAVES):
        return x
    if type(x) in (list, tuple, set, frozenset):
        return type(x)(plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    if isinstance(x, dict) and type(x).__module__ in ("builtins", "collections"):  # dict, OrderedDict
        return type(x)((plain(k, f"{where} key"), plain(v, f"{where}[{k!r}]")) for k, v in x.items())
    raise TypeError(f"{where}: a {type(x).__module__}.{type(x).__qualname__} cannot go into a checkpoint (the safe "
                    "loader reads tensors, numbers, strings, lists, tuples and dicts only): convert it first")


@lru_cache(maxsize=None)
def code_version() -> dict:
    """{"version": the installed cospec's version or None, "commit": this checkout's git HEAD or None, "dirty": bool or
    None}. Never fails: no git, no repository, or no installed package just gives None."""
    try:
        version = metadata.version("cospec")
    except metadata.PackageNotFoundError:
        version = None
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        try:
            r = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": version, "commit": commit, "dirty": None if status is None else bool(status)}


def _mesh(mesh, world: int) -> dict | None:
    if mesh is None:
        return None
    if len(mesh) != 3 or not all(isinstance(n, int) and n >= 1 for n in mesh) or mesh[0] * mesh[1] * mesh[2] != world:
        raise ValueError(f"mesh={mesh}: expected (pp, cp, dp), positive ints with pp * cp * dp = world = {world}")
    return dict(zip(("pp", "cp", "dp"), mesh))


# ---- save ----

def save_checkpoint(folder, step: int, *, states: dict[str, dict], rng: dict, metrics: list | None = None,
                    extra: dict | None = None, config: dict | None = None, mesh: tuple | None = None, rank: int = 0,
                    world: int = 1, barrier: Callable[[], None] | None = None, keep_last: int | None = 3,
                    inputs: dict | None = None) -> Path:
    """Write this rank's part of checkpoint `step` in `folder`; return its path once it is complete for every rank.

    Collective when world > 1: all `world` ranks call it and `barrier()` must synchronise them (e.g. dist.barrier).
    states: the state dicts this rank alone holds, by name ({} for a replica); rng: this rank's `capture_rng(...)`;
    metrics, extra: taken from rank 0. config (a JSON-able dict, e.g. asdict(cfg)) and mesh (pp, cp, dp): recorded
    in the manifest from rank 0, readable without unpickling anything, for resume_policy.check_resumable; inputs (JSON,
    e.g. inputs.input_fingerprints(config)): the content fingerprints of the run's input files, recorded likewise.
    keep_last: complete checkpoints kept, this one included (None: keep all). Checkpoints of later steps are deleted.
    If one rank raises in here the others wait at the next barrier: the process group's timeout bounds that wait.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not in range(world={world})")
    if world > 1 and barrier is None:
        raise ValueError("world > 1 needs a barrier that synchronises every rank (e.g. torch.distributed.barrier)")
    if step < 0 or (keep_last is not None and keep_last < 1):
        raise ValueError(f"need step >= 0 and keep_last >= 1 or None, got step={step}, keep_last={keep_last}")
    barrier = barrier or (lambda: None)
    folder, mesh = Path(folder), _mesh(mesh, world)
    payload = plain({"states": states, "rng": rng}, "states/rng")  # refused here, not at load time
    final = folder / f"step_{step:06d}"
    tmp = folder / (TMP + final.name)  # the same name on every rank, so no rank needs to be told it
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        remove_temporaries(folder)
        _drop_later(folder, step)
        tmp.mkdir()
    barrier()  # sync 1: the empty temp dir exists before anyone writes into it
    _write(tmp / rank_file(rank), lambda f: torch.save(payload, f))
    _write_digest(tmp, rank_file(rank))  # every rank reads its own file back at once: rank 0 hashes no one else's
    if rank == 0:
        meta = plain({"step": step, "world": world, "metrics": list(metrics or []), "extra": dict(extra or {})}, "meta")
        _write(tmp / META, lambda f: torch.save(meta, f))
        _write_digest(tmp, META)
    barrier()  # sync 2: every rank's file and its digest are on disk
    if rank == 0:
        names = [META] + [rank_file(r) for r in range(world)]
        missing = [n for n in names if not (tmp / n).is_file() or not (tmp / (n + DIGEST)).is_file()]
        if missing:
            raise FileNotFoundError(f"{tmp} lacks {missing} (or their digests): is {folder} on a filesystem that every "
                                    "rank shares?")
        files = {n: _read_digest(tmp, n) for n in names}
        manifest = seal({"format": FORMAT, "step": step, "world": world, "mesh": mesh, "config": config,
                         "inputs": inputs, "code": code_version(), "files": files})
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


def remove_temporaries(folder) -> None:
    """Delete the temporary directories of saves or prunes that did not finish (one job per folder: a temp dir is an
    interrupted save's leftover, never a checkpoint)."""
    for stale in Path(folder).glob(TMP + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _remove(p: Path) -> None:
    trash = p.with_name(TMP + "prune-" + p.name)
    os.replace(p, trash)  # vanish atomically first: a crash mid-delete leaves a temp dir, not a broken checkpoint
    shutil.rmtree(trash)


def _drop_later(folder: Path, step: int) -> None:
    """Before saving `step`: delete every checkpoint of a later step, complete or not. This run continues from a step
    before them, so they are another history (an older run in the same folder, or a continuation this run abandoned
    by resuming earlier); left in place, the next --resume would pick them up. Done before the new save commits, so
    no crash can leave a later stale checkpoint beside this run's."""
    later = sorted((s, p) for s, p in step_dirs(folder) if s > step)
    if later:
        warnings.warn(f"deleting the checkpoints of steps {', '.join(str(s) for s, _ in later)} > {step} in {folder}: "
                      "another history than this run's", stacklevel=3)
    for _, p in later:
        _remove(p)


def _prune(folder: Path, step: int, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest `keep_last` up to `step`; the new one is always kept."""
    older = [p for s, p in step_dirs(folder) if s < step and (p / MANIFEST).is_file()]  # newest first
    for p in older[keep_last - 1:]:
        _remove(p)


# ---- find and load ----

def read_manifest(path) -> dict:
    """The manifest of the checkpoint at `path` (JSON: no unpickling), checked for its format."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        why = "no such directory" if not path.is_dir() else f"no {MANIFEST}; find one with latest_checkpoint(folder)"
        raise FileNotFoundError(f"{path} is not a checkpoint ({why})")
    return _manifest(path)


def seal(manifest: dict) -> dict:
    """`manifest` with "sha256": the hash of its own canonical JSON (every other field), so that an edit by hand (say
    the config's lr) makes the checkpoint invalid instead of letting another run resume it."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "sha256": hashlib.sha256(blob).hexdigest()}


_FILE_NAME = re.compile(r"rank\d{5}\.pt|" + re.escape(META))  # what a manifest may list: files of the step directory


def _manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest["format"] != FORMAT or not isinstance(manifest["files"], dict):
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r} (written by another version)")
        if seal(manifest)["sha256"] != manifest.get("sha256"):
            raise ValueError("its sha256 does not match its contents (edited by hand, or written by an older version)")
        outside = [n for n in manifest["files"] if not (isinstance(n, str) and _FILE_NAME.fullmatch(n))]
        if outside:
            raise ValueError(f"it lists {outside[0]!r}: expected {META} and rank<NNNNN>.pt inside the checkpoint "
                             "directory only")
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
    for _, path in step_dirs(folder):
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
    try:  # weights_only=True: no code runs, whatever the file holds (why: module docstring)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        why = re.search(r"WeightsUnpickler error: (.*?)(?: Please |\n|$)", str(e))
        raise ValueError(f"{path / name}: refused by the safe loader (torch.load weights_only=True): "
                         f"{why.group(1) if why else str(e).splitlines()[0]} -- a cospec checkpoint holds tensors and "
                         "plain values only; this file was tampered with or written by other code") from None


def _non_finite(x, where: str = "") -> str | None:
    """The first place in nested dicts / lists holding a floating tensor with a NaN or inf, as "['policy']['w']"."""
    if isinstance(x, torch.Tensor):
        return where if x.is_floating_point() and not bool(torch.isfinite(x).all()) else None
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
    return next((w for k, v in items if (w := _non_finite(v, f"{where}[{k!r}]")) is not None), None)


def load_checkpoint(path, rank: int = 0, *, map_location="cpu") -> dict:
    """Rank `rank`'s part of the checkpoint at `path`: {"step", "world", "states", "rng", "metrics", "extra", "path",
    "mesh", "config", "code"} (the last three from the manifest).

    Each file read is checked against the manifest first; a mismatch here is an error (this checkpoint was asked for).
    """
    path = Path(path)
    manifest = read_manifest(path)
    world = manifest["world"]
    if not 0 <= rank < world:
        raise ValueError(f"{path} was saved by {world} rank(s) and has no file for rank {rank}: "
                         f"resume with the same world size and mesh")
    meta = _read(path, META, manifest, map_location)
    mine = _read(path, rank_file(rank), manifest, map_location)
    bad = _non_finite(mine["states"])
    if bad:  # a diverged run is never saved (train.py checks every step): these bytes were written by something else
        raise ValueError(f"{path / rank_file(rank)}: the weights are not finite (states{bad}); refusing to load them")
    return {"step": meta["step"], "world": world, "states": mine["states"], "rng": mine["rng"],
            "metrics": meta["metrics"], "extra": meta["extra"], "path": path,
            "mesh": manifest.get("mesh"), "config": manifest.get("config"), "code": manifest.get("code")}
