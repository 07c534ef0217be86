"""--draft PATH: a cospec draft from a folder in any format the field publishes (serving/formats.py names them), and
what the run's config takes from that folder.

The family is read from the file; a `--drafter` that names another is refused. Every field the draft takes from the
policy is checked against it (serving/speculators_format.to_cospec: hidden size, vocabulary and d2t / t2d, tap ids in
each format's own convention, mask token, block size, head counts against the weights' shapes), and a mismatch is one
line naming the field. The loaded draft is the warm-up draft: no warm-up runs, and the control arms start from it.

    draft = load_draft("runs/default/draft", policy)                 # any format
    draft = load_draft(path, policy, drafter="dflash")               # and it must hold a DFlash draft
    take_from_draft(cfg)                                             # Config.__post_init__: the family, block fields
"""
from __future__ import annotations

import dataclasses
import os

import torch

from draft import DraftConfig
from harness import drafters
from serving import formats
from serving import speculators_format as spec
from serving.draft_vocab import maps
from serving.export import check_export, check_exportable
from serving.export_checks import read_export_weights

RUN_OPTIONS = ("confidence_threshold",)  # config fields a run sets whatever the file says (not the weights')


def load_draft(path: str, policy, drafter: str | None = None, options: dict | None = None):
    """The draft saved at `path` (any format) for `policy`, in the policy's device and dtype, sharing its embedding
    and LM head. drafter: the family the run expects (None: whatever the file holds); options: the run's values of
    RUN_OPTIONS (drafters.options)."""
    path = formats.resolve(path)
    family, fmt = formats.detect(path)
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
    cfg = formats.read_config(os.path.join(path, "config.json"))
    sd = read_export_weights(path)  # readable and finite, or one line naming the file and tensor
    names = None
    if fmt == "vllm":
        if family == "eagle3":
            check_export(path)  # the format as the engines read it (ENGINE_FIXED, d2t / t2d, dtype)
        cfg, sd, names = formats.from_vllm(family, cfg, sd)
    _, fields, sd = spec.to_cospec(cfg, sd, policy.cfg, path, names)
    if family == "eagle3":  # what the engines feed it: 3 taps, none the policy's last layer (its export needs that)
        try:
            check_exportable(fields["tap_layers"], policy.cfg.num_hidden_layers)
        except ValueError as e:
            raise ValueError(f"draft {path!r}: its taps do not fit the {policy.cfg.num_hidden_layers}-layer "
                             f"policy: {e}") from None
    config = DraftConfig(**fields) if family == "eagle3" else cls.config_class()(**fields)
    p = next(policy.parameters())
    draft = cls(config, policy).to(device=p.device, dtype=p.dtype)
    if family == "eagle3":  # identity maps at a full draft vocabulary, where the file holds none
        Vd = config.draft_vocab_size
        sd["d2t"], sd["t2d"] = maps(torch.arange(Vd) + sd["d2t"] if "d2t" in sd else torch.arange(Vd),
                                    config.vocab_size)
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
    --draft, --drafter auto is eagle3."""
    if not (c.draft and os.path.isfile(os.path.join(formats.resolve(c.draft), "config.json"))):
        c.drafter = "eagle3" if c.drafter == "auto" else c.drafter
        return  # a missing folder: the "draft" row of CHECKS says so
    f = formats.draft_fields(c.draft)
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
