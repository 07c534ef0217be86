"""The draft families by name (`--drafter eagle3|dflash|dspark`): how the config builds, trains and reloads each one.

Everything else speaks to a draft through the drafter protocol (drafter.py) and asks the family's class what it
needs before a draft exists (drafter.FAMILY: its kind, taps rule, block rule, memory terms, --draft loading); this
table is the one place that knows which class a name means, which of the config's flags its constructor and its loss
take, and its single-process training attention. DEFAULT, eagle3, is the default (the experiment's numbers are
EAGLE-3's). A new family is one file and one row: `register(name, Family(cls, ...))` (docs/EXTENDING.md).

    options(cfg, tsk)                                  the family's construction and loss options (a warm-up's key)
    FAMILIES[name].flags                               its config flags: set with a family that reads none, refused
    build_draft(name, policy, opts, tap_layers=, draft_vocab=)   a fresh draft of that family for the policy
    make_trainer(name, draft, opt, opts, ...) / config_trainer(cfg, tsk, draft, opt)   its rl_loop.DraftTrainer
    architecture(path)                                 the family class of a saved draft (config.json names it)
    mask_token_id(cfg, tsk)                            the block drafters' MASK id
    register(name, Family(...))                        one more family (its class checked against drafter.FAMILY)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional

from backends.attention_padded import auto_branch_attention
from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from drafter import check_drafter, check_family
from harness.config_checks import default_mask
from rl_loop import DraftTrainer
from serving.hf_io import read_json


# the config flag each option is read from (options); None: one the whole run reads
OPTION_FLAGS = dict(mask_token_id="mask_token_id", block_size="block_size", num_layers="draft_layers",
                    markov_rank="markov_rank", confidence_threshold="confidence_threshold", anchors="anchors",
                    gamma="block_gamma", seed=None)


@dataclass(frozen=True)
class Family:
    cls: type
    build_keys: tuple  # the options its from_target takes
    loss_keys: tuple  # the options its loss takes (rl_loop.DraftTrainer.opts)
    attn_fn: Optional[Callable] = None  # the single-process training attention (None: the family's default)
    own_flags: tuple = ()  # the config flags it reads beside its options' (EAGLE-3's TTT, draft vocabulary, tree)

    def __post_init__(self):
        check_family(self.cls)  # every class-level member the harness asks (drafter.FAMILY)
        unknown = [k for k in self.build_keys + self.loss_keys if k not in OPTION_FLAGS]
        if unknown:
            raise ValueError(f"Family: options {unknown} have no row in OPTION_FLAGS (the flag each is read from)")

    @property
    def flags(self) -> set:
        """The config flags that are the family's: its options' (OPTION_FLAGS) and its own_flags. A flag set off its
        default that only other families read is refused (config_checks.check_family_flags)."""
        return {OPTION_FLAGS[k] for k in self.build_keys + self.loss_keys if OPTION_FLAGS[k]} | set(self.own_flags)


BLOCK_BUILD, BLOCK_LOSS = ("mask_token_id", "block_size", "num_layers"), ("anchors", "gamma", "seed")
FAMILIES = {
    "eagle3": Family(Eagle3Draft, (), (), auto_branch_attention,
                     ("ttt_passes", "ttt_decay", "draft_vocab", "tree")),
    "dflash": Family(DFlashDraft, BLOCK_BUILD, BLOCK_LOSS),
    "dspark": Family(DSparkDraft, BLOCK_BUILD + ("markov_rank", "confidence_threshold"), BLOCK_LOSS),
}
DEFAULT = "eagle3"  # --drafter auto without --draft


def register(name: str, fam: Family) -> None:
    """One more family under --drafter `name` (a new name; its class's save() name not taken by another)."""
    if not isinstance(fam, Family):
        raise ValueError(f"register: expected a drafters.Family, got {type(fam).__name__}")
    if name in FAMILIES or not name.isidentifier():
        raise ValueError(f"register: name={name!r}: expected a new identifier, not one of {sorted(FAMILIES)}")
    if fam.cls.architecture in by_architecture():
        raise ValueError(f"register: {fam.cls.__name__}.architecture={fam.cls.architecture!r} is another family's")
    FAMILIES[name] = fam


def by_architecture() -> dict:
    """config.json's architectures name -> the family class that saves it."""
    return {f.cls.architecture: f.cls for f in FAMILIES.values()}


def names_by_architecture() -> dict:
    """config.json's architectures name -> the family's --drafter name (serving/formats.detect's `cospec`)."""
    return {f.cls.architecture: name for name, f in FAMILIES.items()}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"drafter={name!r}: expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_list(value: str, flag: str = "drafters") -> list:
    """A comma-separated list of family names (a benchmark's --drafters), or a one-line ValueError naming --flag."""
    names = value.split(",")
    if not value or any(n not in FAMILIES for n in names):
        raise ValueError(f"--{flag}={value!r}: expected a comma-separated subset of {sorted(FAMILIES)}")
    return names


def options(cfg, tsk) -> dict:
    """The family's construction and loss options from the config ({} for eagle3, whose TTT options are the
    trainer's num_passes / pass_weight): part of the draft warm-up's cache key."""
    f = family(cfg.drafter)
    read = dict(mask_token_id=lambda: mask_token_id(cfg, tsk), block_size=lambda: cfg.block_slots,
                num_layers=lambda: cfg.draft_layers, markov_rank=lambda: cfg.markov_rank, anchors=lambda: cfg.anchors,
                gamma=lambda: cfg.block_gamma or None, seed=lambda: cfg.seed,
                confidence_threshold=lambda: cfg.confidence_threshold)  # only the family's own are read
    return {k: read[k]() for k in f.build_keys + f.loss_keys}


def mask_token_id(cfg, tsk) -> int:
    """--mask_token_id when set (>= 0); else the tokenizer's mask token; else the task's pad id when the task never
    emits it (the built-in task's reserved <pad>): config_checks.default_mask. HF mode without either: a one-line
    error naming the flag. That the policy never emits it is checked with the config (config_checks._mask_ok)."""
    if cfg.mask_token_id >= 0:
        return cfg.mask_token_id
    mask = default_mask(tsk.tok, cfg.hf_mode)
    if mask is not None:
        return mask
    raise ValueError(f"--drafter={cfg.drafter}: the tokenizer has no mask token; pass --mask_token_id=ID (an id the "
                     "policy never emits)")


def build_draft(name: str, policy, opts: dict, *, tap_layers=None, draft_vocab=None):
    """A fresh draft of family `name` matched to `policy` (taps: tap_layers or the family's default rule)."""
    f = family(name)
    kw = {k: opts[k] for k in f.build_keys if k in opts}  # a key left out: the constructor's default
    if draft_vocab is not None:
        kw["draft_vocab"] = draft_vocab
    d = f.cls.from_target(policy, tap_layers=tap_layers, **kw)
    check_drafter(d)
    return d


def make_trainer(name: str, draft, opt, opts: dict, *, lam: float = 1.0, grad_clip: float = 1.0,
                 num_passes: int = 3, pass_weight: float = 0.8) -> DraftTrainer:
    """The draft with its optimizer, lambda, clipping and its family's loss options."""
    f = family(name)
    return DraftTrainer(draft, opt, lam=lam, grad_clip=grad_clip, num_passes=num_passes, pass_weight=pass_weight,
                        attn_fn=f.attn_fn, opts={k: opts[k] for k in f.loss_keys})


def config_trainer(cfg, tsk, draft, opt) -> DraftTrainer:
    """make_trainer with the config's lambda, clip, TTT passes / decay and family options."""
    return make_trainer(cfg.drafter, draft, opt, options(cfg, tsk), lam=cfg.draft_lam, grad_clip=cfg.draft_grad_clip,
                        num_passes=cfg.ttt_passes, pass_weight=cfg.ttt_decay)


def architecture(path: str):
    """The family class of a saved draft (config.json's architectures; a file without one: the DEFAULT family's)."""
    known = by_architecture()
    default = FAMILIES[DEFAULT].cls.architecture
    arch = (read_json(os.path.join(path, "config.json")).get("architectures") or [default])[0]
    if arch not in known:
        raise ValueError(f"{path}: unknown draft architecture {arch!r}; expected one of {sorted(known)}")
    return known[arch]


def config_fields(cls) -> set:
    """The config keys a saved draft of family class `cls` holds."""
    return {f.name for f in dataclasses.fields(cls.config_class())}
