"""Honest resumes: a run continues only itself, never silently starts over, and loses no earlier result.

A run's output directory <out> holds its results (metrics.jsonl, summary.json, train.png) and, with --ckpt_every, its
checkpoints in <out>/ckpt (checkpoint.py). The rules, one function each:

    fresh run (no --resume)    check_fresh_out_dir: refuse <out> if <out>/ckpt holds checkpoints (they are another
                               run's: --resume continues it, --overwrite deletes them, or pick a new --out). A directory
                               without checkpoints (the README's second run) stays allowed;
                               prepare_fresh_out_dir: with --overwrite delete the old ckpt/; otherwise move earlier
                               results (RESULTS: metrics, summary, plot, the servables policy/ and draft/, tb/, wandb/)
                               aside into <out>/earlier-<n>/ so the new run overwrites nothing.
    --resume                   checkpoint_to_resume: the newest valid checkpoint, or an error (never a silent step 0);
                               check_resumable: refuse a checkpoint written on another mesh (pp, cp, dp) or with a
                               config that differs outside RESUME_MAY_CHANGE, naming each field with both values, or
                               whose input files (--model, --data, --chat_template) now hold other bytes (inputs.py;
                               --resume_changed_inputs accepts that); the code version only warns (a bug fix between
                               save and resume is legitimate);
                               keep_later_metrics: a metrics.jsonl holding steps after the checkpoint (they existed
                               only there) is moved into earlier-<n>/ before the resumed run rewrites it.
    every start                export.recover_swaps: a servable directory swap a kill interrupted is finished.
    every save                 checkpoint.save_checkpoint deletes checkpoints of later steps (another history), so a
                               later --resume cannot jump into an older run's future.

    all of the above          start_run(prepare=False): the read-only checks, before the run builds anything;
                               prepare_run: the moves and deletions, once the config, the data, the model and the
                               warm-up caches have loaded (experiment.build), so that a run refused for bad input
                               leaves <out> as it was. Rank 0 decides, every rank gets the same answer (the checkpoint
                               to load, or the same error), so no rank is left waiting in a collective for one that
                               raised. start_run() alone does both at once.

Everything here reads JSON (the manifest) or moves directories: no checkpoint file is unpickled.

    python -c "from checkpoints.resume_policy import check_fresh_out_dir; check_fresh_out_dir('runs/default')"
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist

from checkpoints.checkpoint import TMP, step_dirs, code_version, latest_checkpoint, read_manifest
from checkpoints.inputs import changed_inputs, input_fingerprints
from serving.export import recover_swaps

# what train.py writes into <out> besides ckpt/: results, servables, the --log backends' folders
RESULTS = ("metrics.jsonl", "summary.json", "config.json", "train.png", "policy", "draft", "tb", "wandb")

# Config fields a resume may change: run length and housekeeping, nothing that changes what a step computes.
# pp, cp, dp are compared as the resolved mesh instead (dp=0 and dp=2 may be the same mesh).
RESUME_MAY_CHANGE = frozenset({"steps", "threads", "warmup_threads", "dist_timeout", "eval_every", "ckpt_every",
                               "device", "out", "cache_dir", "resume", "overwrite", "log",
                               "resume_changed_inputs"})
MESH_FIELDS = ("pp", "cp", "dp")


class NoCheckpointError(FileNotFoundError):
    """--resume found no valid checkpoint: the run must stop (non-zero exit), not start over."""


# ---- a fresh run ----

def check_fresh_out_dir(out_dir, overwrite: bool = False) -> None:
    """Refuse a fresh run into `out_dir` when <out>/ckpt holds checkpoints (complete or not), unless `overwrite`.

    Read-only, so under torchrun every rank may call it (all see the same shared folder, all raise together)."""
    ckpt = Path(out_dir) / "ckpt"
    found = step_dirs(ckpt)
    if found and not overwrite:
        steps = ", ".join(str(s) for s, _ in sorted(found))
        raise FileExistsError(f"{ckpt} holds checkpoints of an earlier run (steps {steps}): add --resume to continue "
                              f"it, --overwrite to delete them and start over, or choose a new --out")


def prepare_fresh_out_dir(out_dir, overwrite: bool = False, results=RESULTS) -> list[str]:
    """After check_fresh_out_dir, on rank 0 only, before anything is written: make `out_dir` ready for a new run.

    overwrite: <out>/ckpt is deleted (renamed away first, so a crash mid-delete leaves no half checkpoint folder) and
    the new run's results replace the old ones. Otherwise earlier results are moved into <out>/earlier-<n>/ (n the
    first free number), never overwritten. Returns one line per action, for the log."""
    out, notes = Path(out_dir), []
    check_fresh_out_dir(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"
    if overwrite and ckpt.exists():
        trash = out / (TMP + "overwritten-ckpt")
        if trash.exists():
            shutil.rmtree(trash)  # a crashed earlier --overwrite's leftover
        os.replace(ckpt, trash)
        shutil.rmtree(trash)
        notes.append(f"--overwrite: deleted the earlier checkpoints in {ckpt}")
    earlier = [n for n in results if (out / n).exists()]
    if earlier and not overwrite:
        dest = earlier_dir(out)
        for name in earlier:
            os.replace(out / name, dest / name)
        notes.append(f"kept the earlier results: {', '.join(earlier)} moved to {dest}")
    return notes


def earlier_dir(out: Path) -> Path:
    """A new, empty <out>/earlier-<n> (n the first free number)."""
    n = 1
    while (out / f"earlier-{n}").exists():
        n += 1
    (out / f"earlier-{n}").mkdir()
    return out / f"earlier-{n}"


# ---- a resume ----

def require_checkpoint(path, folder) -> Path:
    """`path` (e.g. latest_checkpoint(folder), broadcast from rank 0) or NoCheckpointError naming `folder`."""
    if path is not None:
        return Path(path)
    folder = Path(folder)
    damaged = len(step_dirs(folder))
    why = (f"its {damaged} checkpoint(s) are damaged or incomplete, see the warnings above" if damaged
           else "it holds no checkpoint" if folder.is_dir() else "no such directory")
    raise NoCheckpointError(f"--resume: no valid checkpoint in {folder} ({why}); nothing to continue. Run without "
                            f"--resume to start a new run (with --overwrite, or a new --out, if {folder} has any)")


def checkpoint_to_resume(folder) -> Path:
    """The newest valid checkpoint in `folder`; NoCheckpointError when there is none (one process)."""
    return require_checkpoint(latest_checkpoint(folder), folder)


def _norm(v):
    return json.loads(json.dumps(v))  # compare as the manifest stores it (tuples -> lists)


def config_differences(saved: dict, current: dict, may_change=RESUME_MAY_CHANGE) -> list[str]:
    """'field: saved X, now Y' for every field outside `may_change` (and the mesh fields) that differs."""
    absent = "(absent)"
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in may_change or key in MESH_FIELDS:
            continue
        a, b = saved.get(key, absent), _norm(current.get(key, absent))
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, now {b!r}")
    return out


def check_resumable(path, config: dict, mesh: tuple, may_change=RESUME_MAY_CHANGE) -> None:
    """Refuse to resume from the checkpoint at `path` with this run's `config` (asdict(cfg)) on `mesh` (pp, cp, dp).

    Reads the manifest only. Raises ValueError for another mesh, a config that differs outside `may_change` (every
    such field named, with both values), or fewer `steps` than the checkpoint has done; warns when the code version
    differs. Cheap and read-only: every rank may call it."""
    path = Path(path)
    m = read_manifest(path)
    now = dict(zip(MESH_FIELDS, mesh))
    if m.get("mesh") is None or m.get("config") is None:
        raise ValueError(f"{path}: the checkpoint records no mesh or config, so it cannot be checked against this "
                         "run; resume refused (start a new run)")
    show = lambda d: " x ".join(f"{k}={d[k]}" for k in MESH_FIELDS)  # noqa: E731
    if m["mesh"] != now:
        flags = " ".join(f"--{k}={m['mesh'][k]}" for k in MESH_FIELDS)
        raise ValueError(f"{path} was written on the mesh {show(m['mesh'])}, this run's is {show(now)}: each rank "
                         f"file holds its own pipeline stage's slice, so a checkpoint resumes on its own mesh only "
                         f"(resume with {flags} on {m['world']} rank(s), or start a new run)")
    diff = config_differences(m["config"], config, may_change)
    if diff:
        raise ValueError(f"{path} belongs to a run with another config; {'; '.join(diff)}. A resume may change only "
                         f"{', '.join(sorted(may_change))}: resume with the checkpoint's values, or start a new run "
                         "(a new --out, or --overwrite)")
    if "steps" in config and config["steps"] < m["step"]:
        raise ValueError(f"{path} has done {m['step']} steps: --steps={config['steps']} is fewer (expected >= "
                         f"{m['step']})")
    changed = changed_inputs(m.get("inputs"), input_fingerprints(config), config)
    if changed and not config.get("resume_changed_inputs"):
        raise ValueError(f"{path} was written by a run that read other inputs; {'; '.join(changed)}. "
                         "A resume continues "
                         "the same run only: restore the inputs, start a new run, or add --resume_changed_inputs to "
                         "continue on the new ones")
    saved, here = m.get("code") or {}, code_version()
    if (saved.get("version"), saved.get("commit")) != (here["version"], here["commit"]):
        warnings.warn(f"{path} was written by cospec {saved.get('version')} at commit {saved.get('commit')}, this is "
                      f"{here['version']} at {here['commit']}: resuming with the new code", stacklevel=2)


def keep_later_metrics(out_dir, step: int) -> list[str]:
    """Before a resume from checkpoint `step` rewrites <out>/metrics.jsonl from the checkpoint's records: if the file
    holds records the checkpoint does not (steps after it, or an unreadable line), move it into <out>/earlier-<n>/."""
    out = Path(out_dir)
    path = out / RESULTS[0]
    if not path.is_file():
        return []
    try:
        later = any(json.loads(line)["step"] > step for line in path.read_text().splitlines() if line.strip())
    except (ValueError, KeyError, TypeError):
        later = True  # a line cut short by the kill: keep the file as it is
    if not later:
        return []
    dest = earlier_dir(out)
    os.replace(path, dest / RESULTS[0])
    return [f"kept the records after step {step}: {path} moved to {dest} (the resumed run rewrites it from step 1)"]


# ---- the calls the loop makes ----

_RAISE = {"NoCheckpointError": NoCheckpointError, "FileExistsError": FileExistsError,
          "FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "OSError": OSError}


def _from_rank0(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _decide(work, rank: int, share):
    """work() on rank 0 -> ("ok", value) or ("error", class name, message), shared with every rank; the value, or the
    same error raised on every rank."""
    if share is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        share = _from_rank0
    verdict = None
    if rank == 0:
        try:
            verdict = ("ok", work())
        except (OSError, ValueError) as e:  # e.g. a permission error moving files: every rank must hear of it too
            verdict = ("error", next(c.__name__ for c in type(e).__mro__ if c.__name__ in _RAISE), str(e))
    if share is not None:
        verdict = share(verdict)
    if verdict[0] == "error":
        raise _RAISE[verdict[1]](verdict[2])
    return verdict[1]


def start_run(out_dir, config: dict, mesh: tuple, *, rank: int = 0, share=None,
              prepare: bool = True) -> tuple[Path | None, list[str]]:
    """Apply the rules above: -> (checkpoint to load or None, notes to print).

    config: asdict(cfg) (its `resume` and `overwrite` fields choose the case); mesh: (pp, cp, dp), (1, 1, 1) for one
    process. prepare=False: the checks only, nothing on disk changes (then prepare_run, once the run has built).
    Rank 0 does the work (it alone hashes checkpoints and moves files) and `share(obj)` hands its verdict to every
    rank (default: a broadcast from rank 0 when torch.distributed runs with world > 1, else nothing to share). Every
    rank then returns the same path, or raises the same error (NoCheckpointError, FileExistsError, ValueError,
    OSError): a collective when world > 1."""
    def work():
        if config.get("resume"):
            path = checkpoint_to_resume(Path(out_dir) / "ckpt")
            check_resumable(path, config, mesh)
            return str(path), [f"resume: from {path}"]
        check_fresh_out_dir(out_dir, bool(config.get("overwrite")))
        return None, []
    path, notes = _decide(work, rank, share)
    path = None if path is None else Path(path)
    if prepare:
        notes += prepare_run(out_dir, config, path, rank=rank, share=share)
    return path, (notes if rank == 0 else [])


def prepare_run(out_dir, config: dict, resume_from, *, rank: int = 0, share=None) -> list[str]:
    """The changes start_run(prepare=False) held back, on rank 0, once the run has built: an interrupted servable
    swap finished (export.recover_swaps); a fresh run's earlier results moved aside (or with --overwrite the old
    checkpoints deleted); a resume's later metric records kept. -> notes (rank 0; [] elsewhere); errors as
    start_run's, on every rank."""
    def work():
        notes = recover_swaps(out_dir)
        if resume_from is None:
            return notes + prepare_fresh_out_dir(out_dir, bool(config.get("overwrite")))
        return notes + keep_later_metrics(out_dir, read_manifest(resume_from)["step"])
    notes = _decide(work, rank, share)
    return notes if rank == 0 else []
