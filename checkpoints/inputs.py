"""What a run read from disk, fingerprinted by content: a checkpoint records it, and a resume continues only the run
that read the same bytes.

    fp = input_fingerprints(config)      {"model": {file: sha256} of an HF --model directory (None for a preset),
                                          "data": sha256 of --data, "chat_template": sha256 of a --chat_template FILE}
    changed_inputs(saved, fp, config)    one line per input whose contents differ, naming the flag and the file

The config strings alone cannot tell: the same --model path with new weights, or the same --data path with other
answers, is another run (the frozen reference and the rewards change). Every byte of the model directory is hashed
(its weights, config and tokenizer); the hash is kept per process for an unchanged (size, mtime) of each file, so a
run pays for it once, not at every checkpoint.
"""
from __future__ import annotations

import functools
import hashlib
import os

from tasks.hf_data import file_sha256

INPUTS = ("model", "data", "chat_template")  # the Config fields that name files a run reads


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # keyed by the file's stat: a rewritten file is read again
    return file_sha256(path)


def _file(path: str) -> str:
    st = os.stat(path)
    return _sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _directory(path: str) -> dict:
    return {os.path.relpath(os.path.join(r, f), path).replace(os.sep, "/"): _file(os.path.join(r, f))
            for r, _, files in sorted(os.walk(path)) for f in sorted(files)}


def input_fingerprints(config: dict) -> dict:
    """{input: its contents' fingerprint} for the files `config` (asdict(cfg)) names; None where it names none."""
    out = dict.fromkeys(INPUTS)
    model, data, template = (config.get(k) or "" for k in INPUTS)
    if model and os.path.isdir(model):
        out["model"] = _directory(model)
    if data and os.path.isfile(data):
        out["data"] = _file(data)
    if template and os.path.isfile(template):
        out["chat_template"] = _file(template)
    return out


def changed_inputs(saved: dict | None, now: dict, config: dict) -> list[str]:
    """'--model=DIR: model.safetensors changed' etc. for every input whose fingerprint differs from `saved`'s."""
    saved = saved or {}
    out = []
    for key in INPUTS:
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        where = f"--{key}={config.get(key)}"
        if isinstance(a, dict) and isinstance(b, dict):
            files = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            what = ", ".join(f"{n} {'added' if n not in a else 'removed' if n not in b else 'changed'}"
                             for n in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
            out.append(f"{where}: {what} since the checkpoint")
        elif a is None or b is None:
            out.append(f"{where}: the checkpoint records no such file, this run reads one" if a is None else
                       f"{where}: the checkpoint's run read a file here, this run reads none")
        else:
            out.append(f"{where}: its contents changed since the checkpoint (sha256 {a[:12]} -> {b[:12]})")
    return out
