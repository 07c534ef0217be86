"""The draft families by name (`--drafter eagle3|dflash|dspark`): how the config builds, trains and reloads each one.

Everything else speaks to a draft through the drafter protocol (drafter.py); this table is the one place that knows
which class a name means, which of the config's flags its constructor and its loss take, and its single-process
training attention. eagle3 is the default (the experiment's numbers are EAGLE-3's).

    build_draft(cfg, policy, tsk, tap_layers=..., draft_vocab=...)   a fresh draft of cfg.drafter for the policy
    make_trainer(cfg, draft, opt)                                    its rl_loop.DraftTrainer (lam, clip, loss options)
    load_cached(path, policy)                                        a saved draft of any family (config.json names it)
    mask_token_id(cfg, tsk)                                          the block drafters' MASK id
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

from backends.attention_padded import padded_branch_attention
from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from drafter import check_drafter
from rl_loop import DraftTrainer


@dataclass(frozen=True)
class Family:
    cls: type
    build_kw: Callable  # (cfg, tsk) -> from_target's family keywords
    loss_opts: Callable  # cfg -> DraftTrainer.opts
    attn_fn: Optional[Callable] = None  # the single-process training attention (None: the family's default)


def _block_kw(cfg, tsk) -> dict:
    return dict(mask_token_id=mask_token_id(cfg, tsk), block_size=cfg.block_size, num_layers=cfg.draft_layers)


def _block_opts(cfg) -> dict:
    return dict(anchors=cfg.anchors, gamma=cfg.block_gamma or None, seed=cfg.seed)


FAMILIES = {
    "eagle3": Family(Eagle3Draft, lambda cfg, tsk: {}, lambda cfg: {}, padded_branch_attention),
    "dflash": Family(DFlashDraft, _block_kw, _block_opts),
    "dspark": Family(DSparkDraft, lambda cfg, tsk: dict(_block_kw(cfg, tsk), markov_rank=cfg.markov_rank),
                     _block_opts),
}
BY_ARCHITECTURE = {"Eagle3DraftModel": Eagle3Draft, DFlashDraft.architecture: DFlashDraft,
                   DSparkDraft.architecture: DSparkDraft}


def family(cfg) -> Family:
    if cfg.drafter not in FAMILIES:
        raise ValueError(f"drafter={cfg.drafter!r}: expected one of {sorted(FAMILIES)}")
    return FAMILIES[cfg.drafter]


def mask_token_id(cfg, tsk) -> int:
    """--mask_token_id when set (>= 0); else the tokenizer's mask token; else the task's pad id when the task never
    emits it (the built-in task's reserved <pad>). HF mode without either: a one-line error naming the flag."""
    if cfg.mask_token_id >= 0:
        return cfg.mask_token_id
    tok = tsk.tok
    mask = getattr(tok, "mask_id", None)
    if mask is not None:
        return int(mask)
    if not cfg.hf_mode:
        return int(tok.pad_id)
    raise ValueError(f"--drafter={cfg.drafter}: the tokenizer has no mask token; pass --mask_token_id=ID (an id the "
                     "policy never emits)")


def build_draft(cfg, policy, tsk, *, tap_layers=None, draft_vocab=None):
    """A fresh draft of cfg.drafter matched to `policy` (taps: tap_layers or the family's default rule)."""
    f = family(cfg)
    kw = dict(f.build_kw(cfg, tsk), tap_layers=tap_layers)
    if draft_vocab is not None:
        kw["draft_vocab"] = draft_vocab
    d = f.cls.from_target(policy, **kw)
    check_drafter(d)
    return d


def make_trainer(cfg, draft, opt) -> DraftTrainer:
    """The draft with its optimizer, lambda, clipping and the family's loss options from the config."""
    f = family(cfg)
    return DraftTrainer(draft, opt, lam=cfg.draft_lam, grad_clip=cfg.draft_grad_clip, num_passes=cfg.ttt_passes,
                        pass_weight=cfg.ttt_decay, attn_fn=f.attn_fn, opts=f.loss_opts(cfg))


def load_cached(path: str, policy):
    """A draft saved by its family's `save` (config.json's architectures names the family)."""
    with open(os.path.join(path, "config.json")) as fh:
        arch = (json.load(fh).get("architectures") or ["Eagle3DraftModel"])[0]
    if arch not in BY_ARCHITECTURE:
        raise ValueError(f"{path}: unknown draft architecture {arch!r}; expected one of {sorted(BY_ARCHITECTURE)}")
    return BY_ARCHITECTURE[arch].load(path, policy)


def config_fields(draft_or_path) -> set:
    """The config keys a saved draft of this family may hold (warmup.load_draft's check)."""
    import dataclasses
    cls = draft_or_path
    return {f.name for f in dataclasses.fields(cls.config_class())}
