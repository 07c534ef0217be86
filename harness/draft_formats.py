"""--draft PATH: a cospec draft from a folder in any format the field publishes (serving/formats.py names them), and
what the run's config takes from that folder.

The family is read from the file; a `--drafter` that names another is refused. Every field the draft takes from the
policy is checked against it (serving/speculators_format.to_cospec: hidden size, vocabulary and d2t / t2d, tap ids in
each format's own convention, mask token, block size, head counts against the weights' shapes), and a mismatch is one
line naming the field. The loaded draft is the warm-up draft: no warm-up runs, and the control arms start from it.

    draft = load_draft("runs/default/draft", policy)                 # any format
    draft = load_draft(path, policy, drafter=name)                   # and it must hold that family's draft
    take_from_draft(cfg)                                             # Config.__post_init__: the family, block fields
"""
from __future__ import annotations

import dataclasses
import os

import torch

from harness import drafters
from serving import formats
from serving import speculators_format as spec
from serving.export_checks import read_export_weights

RUN_OPTIONS = ("confidence_threshold",)  # config fields a run sets whatever the file says (not the weights')


def load_draft(path: str, policy, drafter: str | None = None, options: dict | None = None):
    """The draft saved at `path` (any format) for `policy`, in the policy's device and dtype, sharing its embedding
    and LM head. drafter: the family the run expects (None: whatever the file holds); options: the run's values of
    RUN_OPTIONS (drafters.options)."""
    path = formats.resolve(path)
    family, fmt = formats.detect(path, drafters.names_by_architecture())
    if drafter is not None and drafter != family:
        raise ValueError(f"--drafter {drafter}: {path!r} holds a {family} draft ({fmt} format); pass --drafter "
                         f"{family} or leave --drafter out")
    cls = drafters.family(family).cls
    if fmt == "cospec":
        draft = cls.load(path, policy)
    else:
        draft = _from_file(cls, family, fmt, path, policy)
    run = {k: v for k, v in (options or {}).items() if k in RUN_OPTIONS and hasattr(draft.cfg, k)}
    if run:
        draft.cfg = dataclasses.replace(draft.cfg, **run)
    return draft


def _from_file(cls, family: str, fmt: str, path: str, policy):
    """A served file's draft: the family's class checks the file (check_file: EAGLE-3's vLLM file as the engines
    read it) and turns the format's fields into its config (from_fields: EAGLE-3's taps the engines can feed, its
    identity vocabulary maps)."""
    cfg = formats.read_config(os.path.join(path, "config.json"))
    sd = read_export_weights(path)  # readable and finite, or one line naming the file and tensor
    names = None
    if fmt == "vllm":
        cls.check_file(path, fmt)
        cfg, sd, names = formats.from_vllm(family, cfg, sd)
    _, fields, sd = spec.to_cospec(cfg, sd, policy.cfg, path, names)
    config, sd = cls.from_fields(fields, sd, path, policy.cfg.num_hidden_layers)
    p = next(policy.parameters())
    draft = cls(config, policy).to(device=p.device, dtype=p.dtype)
    try:
        draft.load_state_dict({k: v if v.dtype in (torch.int64, torch.bool) else v.to(p.dtype) for k, v in sd.items()})
    except RuntimeError as e:
        raise ValueError(f"draft {path!r}: its weights do not fit a cospec {family} draft of this config: "
                         + " ".join(str(e).split())[:400]) from None
    draft.attach(policy)
    return draft


def take_from_draft(c):
    """--draft PATH on Config `c`: the family (--drafter auto) and a block draft's block_size, mask_token_id,
    draft_layers and markov_rank come from the file; a flag set to another value is refused naming it. Without
    --draft, --drafter auto is drafters.DEFAULT."""
    if not (c.draft and os.path.isfile(os.path.join(formats.resolve(c.draft), "config.json"))):
        c.drafter = drafters.DEFAULT if c.drafter == "auto" else c.drafter
        return  # a missing folder: the "draft" row of CHECKS says so
    f = formats.draft_fields(c.draft, drafters.names_by_architecture())
    if c.drafter not in ("auto", f["family"]):
        raise ValueError(f"--drafter {c.drafter}: --draft {c.draft!r} holds a {f['family']} draft ({f['format']} "
                         f"format); pass --drafter {f['family']} or leave --drafter out")
    c.drafter = f["family"]
    defaults = {x.name: x.default for x in dataclasses.fields(c)}
    for flag, key in (("block_size", "block_size"), ("mask_token_id", "mask_token_id"),
                      ("draft_layers", "num_layers"), ("markov_rank", "markov_rank")):
        if key not in f:
            continue
        if getattr(c, flag) not in (defaults[flag], f[key]):
            raise ValueError(f"--{flag}={getattr(c, flag)}: --draft {c.draft!r} has {key}={f[key]}; leave --{flag} "
                             "out (the draft brings its own)")
        setattr(c, flag, f[key])
