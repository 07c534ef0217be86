"""A draft family's own checkpoint, what its `save` writes and its `load` reads (drafter.py's protocol): config.json
(the config's fields, with `architectures` naming the family) and model.safetensors (the draft's own weights, not the
policy's shared embedding or head), each file replaced atomically. The serving formats are export.py's.

    write_draft(path, cfg, sd)                    config.json + model.safetensors into the directory `path`
    read_draft(path, architecture=None)           -> (config fields, state dict); a ValueError names the path
"""
from __future__ import annotations

import json
import os

from safetensors.torch import load_file, save_file

from serving.hf_io import read_json


def write_draft(path: str, cfg: dict, sd: dict):
    """cfg (JSON-ready, `architectures` included) and sd {name: tensor} into `path` (created if needed); each file is
    written beside its place and renamed over it, so a reader sees the old file or the new one, never half of one."""
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    for name, write in (("model.safetensors", lambda f: save_file(sd, f, metadata={"format": "pt"})),
                        ("config.json", lambda f: open(f, "w").write(json.dumps(cfg, indent=2)))):
        tmp = os.path.join(path, f".{name}.tmp")
        write(tmp)
        os.replace(tmp, os.path.join(path, name))


def read_draft(path: str, architecture: str | None = None) -> tuple:
    """(config fields without `architectures`, state dict) of a draft saved by write_draft. architecture: the
    family's name its config.json must carry (None: any). A directory without config.json, or of another family, is a
    ValueError naming the path."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"path={path!r}: expected a draft directory with config.json")
    raw = read_json(cfg_path)
    if raw.pop("architectures", [None]) != [architecture] and architecture is not None:
        raise ValueError(f"path={path!r}: not a {architecture} checkpoint")
    return raw, load_file(os.path.join(path, "model.safetensors"))
