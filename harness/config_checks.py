"""The pieces Config's per-field checks (harness/config.CHECKS) are built from: the row makers (a range, a choice, a
flag), the type checks and the helpers some rows call (can this directory be written, does the policy have these
layers, which sizes do the updates cut, can the policy emit this MASK id: the run's tokenizer read at check time),
and the check across the draft families (check_family_flags: a flag only another family reads).

May import parallel, tasks and model (the presets), nothing of harness but presets; backend_problem imports
backends.attention_flash when it asks flash-attn itself.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from model import PRESETS as MODEL_PRESETS
from parallel.cli import show_value as _show


def at_least(lo):
    return (lambda v, c: v >= lo), f">= {lo}"


def above(lo):
    return (lambda v, c: v > lo), f"> {lo}"


def one_of(*choices):
    return (lambda v, c: v in choices), "one of " + ", ".join(choices)


FLAG = (lambda v, c: True, "true or false")  # the type check is the whole check
AUTO_FLAG = (lambda v, c: v in (True, False, "auto"), "true, false or auto")


def _update_sizes(c) -> list:
    """Sequences per update: harness/update.py cuts the step's prompts_per_step * group_size with torch.chunk."""
    S, u = c.prompts_per_step * c.group_size, c.updates
    size = -(-S // max(u, 1))
    if size < 1:  # a bad prompts_per_step / group_size has its own error
        return []
    return [min(size, S - i) for i in range(0, S, size)]


def _parses(parse, value) -> bool:
    """True when parse(value) accepts it (a task name, a --log list); its ValueError means the value is refused."""
    try:
        parse(value)
        return True
    except ValueError:
        return False


def _writable_dir(path: str) -> bool:
    """`path` is a directory this process may write, or one it may create: its nearest existing ancestor is a
    writable directory (no file in the way, no read-only mount). Read-only: nothing is created here."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)


def _installed(backends) -> bool:
    """Every --log backend's package is importable (tensorboard, wandb), found without importing it."""
    import importlib.util
    return all(importlib.util.find_spec(b) is not None for b in backends if b != "jsonl")


def backend_problem(c, device) -> str | None:
    """Why c.attn_backend cannot run with the models on `device` (a torch.device), or None. torch runs anywhere.
    triton: the triton package and a CUDA device, or on the CPU Triton's interpreter (TRITON_INTERPRET=1, set
    before launch: how the tests run its kernels). flash: a CUDA device, flash-attn importable at its minimum
    version (backends/attention_flash.flash_interface, the backend's own check), fp16/bf16 models (its kernels take
    no fp32), and with a block drafter also triton: a block's anchor attention runs there
    (draft_block.anchor_backend)."""
    import importlib.util
    b, cuda, triton = c.attn_backend, device.type == "cuda", importlib.util.find_spec("triton") is not None
    cpu_hint = "on the CPU use --attn_backend torch (auto picks it)"
    if b == "triton" and not triton:
        return "needs the triton package (pip install triton; it comes with torch's CUDA builds)"
    if b == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"needs a CUDA device; {cpu_hint}, or set TRITON_INTERPRET=1 before launch to run Triton's "
                "kernels in its interpreter (slow: for tests)")
    if b != "flash":
        return None
    if not cuda:
        return f"needs a CUDA device (flash-attn has no CPU kernels); {cpu_hint}"
    if c.dtype == "fp32":
        return ("flash-attn takes fp16/bf16 only, got --dtype=fp32; use --dtype bf16 (auto on CUDA) or "
                "--attn_backend triton")
    if _kind(c) == "block" and not c.no_spec and not triton:
        return (f"with --drafter {c.drafter} needs the triton package too (a block's anchor attention has "
                "per-anchor key ends that flash-attn lacks: it runs on triton)")
    from backends.attention_flash import flash_interface
    try:
        flash_interface()
    except RuntimeError as e:
        return str(e)
    return None


def _policy_layers(c) -> int | None:
    """The policy's number of layers: the --model preset's, or an HF checkpoint's config.json; None if unreadable."""
    if c.model in MODEL_PRESETS:
        return MODEL_PRESETS[c.model].num_hidden_layers
    try:
        with open(os.path.join(c.model, "config.json")) as f:
            return int(json.load(f)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the model's own row reports it


def _kind(c) -> str | None:
    """The run's family's kind, "chain" or "block" (drafter.FAMILY); None for a --drafter no family has (its row
    says so)."""
    return getattr(c.draft_family, "kind", None)


def _taps_ok(taps: tuple, c) -> bool:
    """() or ascending distinct integer layer ids that the run's family takes (its taps_ok: EAGLE-3's served format
    reads exactly 3 in [0, n - 2], serving/export.py; vLLM's DFlash format any number in [0, n - 1])."""
    n = _policy_layers(c)
    if not isinstance(taps, tuple):
        return False
    if taps == () or n is None:
        return True
    return (all(type(t) is int for t in taps) and list(taps) == sorted(set(taps))
            and (c.draft_family is None or c.draft_family.taps_ok(taps, n)))


def taps_rule(families: dict) -> str:
    """The --tap_layers row's rule: each family's taps_rule, the families that share one named together."""
    rules = {}
    for name, f in families.items():
        rules.setdefault(f.cls.taps_rule, []).append(name)
    return "'' (the family's default rule) or, " + "; ".join(f"for {' / '.join(n)}, {r}" for r, n in rules.items())


BLOCK_MAX = 64  # a block's most slots W: --block_size's range is [2, BLOCK_MAX], and so is the W that 0 fits to k


def _fits_block(k, c) -> bool:
    """--num_draft_tokens / --eval_draft_tokens = k: where --block_size=0 fits a block drafter's block to it (its
    fitted_block(k)), that block holds at most BLOCK_MAX slots (an explicit --block_size has its own row; a chain
    drafter has no block)."""
    return (_kind(c) != "block" or c.block_size != 0 or type(k) is not int
            or c.draft_family.fitted_block(k) <= BLOCK_MAX)


def _blocks(families: dict) -> list:
    """(name, class) of the block families, in the registry's order: the first's rule is stated, the others' beside
    it ("k + 1 (dspark: k)")."""
    return [(name, f.cls) for name, f in families.items() if f.cls.kind == "block"]


def _others(pairs: list) -> str:  # [(name, text), ...] past the first -> "name1: text1; name2: text2"
    return "; ".join(f"{n}: {t}" for n, t in pairs[1:])


def fits_block_rule(families: dict) -> str:
    """The rule _fits_block checks, in words: the most k --block_size=0 fits to each block family."""
    most = [(n, max(k for k in range(1, BLOCK_MAX + 1) if c.fitted_block(k) <= BLOCK_MAX)) for n, c in
            _blocks(families)]
    fit = [(n, c.fit_rule) for n, c in _blocks(families)]
    if not most:
        return "no family has a block"
    side = lambda pairs: f" ({_others(pairs)})" if len(pairs) > 1 else ""  # noqa: E731
    return (f"with --drafter {most[0][0]} and --block_size=0 at most {most[0][1]}{side(most)}: the block fitted to "
            f"it, {fit[0][1]} slots{side(fit)}, holds at most {BLOCK_MAX}, as --block_size does")


def block_size_rule(families: dict) -> str:
    """--block_size's row: 0 (the block fitted to k, by family) or in [2, BLOCK_MAX]."""
    fit = [(n, c.fit_rule) for n, c in _blocks(families)]
    first = "; ".join([fit[0][1]] + [_others(fit)] * (len(fit) > 1)) if fit else "no block"
    return f"0 ({first}) or in [2, {BLOCK_MAX}]"


def drafter_rule(families: dict) -> str:
    """--drafter's row: a family's name; a block family's k fixed and at most the slots its block drafts."""
    blocks = _blocks(families)
    slots = [(n, c.slots_rule) for n, c in blocks]
    text = f"one of {', '.join(families)}"
    if blocks:
        text += (f"; a block drafter ({', '.join(n for n, _ in blocks)}) with a fixed --num_draft_tokens and "
                 f"--eval_draft_tokens <= {slots[0][1]}{f' ({_others(slots)})' if len(slots) > 1 else ''}; "
                 "--block_size=0, the default, fits the block to them")
    return text


def _block_ok(c) -> bool:
    """A block drafter's k: fixed, at most its trained slots (its slots_drafted(W), W = c.block_slots). A chain
    family's flags (EAGLE-3's --tree, --draft_vocab) are refused here by check_family_flags."""
    most = c.draft_family.slots_drafted(c.block_slots)
    k = c.num_draft_tokens
    return type(k) is int and k <= most and (c.eval_draft_tokens or k) <= most


def family_rows(families: dict) -> dict:
    """config.CHECKS' rows whose rule depends on the registered draft families (harness/drafters.FAMILIES): what each
    family's class says of its taps, its block and its k (drafter.FAMILY). Config.__post_init__ refreshes them, so
    a family registered after import has its rules checked and named."""
    fits = fits_block_rule(families)
    return {
        "tap_layers": ((lambda v, c: _taps_ok(v, c)), taps_rule(families)),
        "drafter": ((lambda v, c: v in families and (families[v].cls.kind != "block" or _block_ok(c))),
                    drafter_rule(families)),
        "block_size": ((lambda v, c: v == 0 or 2 <= v <= BLOCK_MAX), block_size_rule(families)),
        "mask_token_id": mask_row(families),
        "num_draft_tokens": ((lambda v, c: v == "auto" or (type(v) is int and v >= 1 and _fits_block(v, c))),
                             f">= 1, or auto (adaptive, at most max_draft_tokens); {fits}"),
        "eval_draft_tokens": ((lambda v, c: v >= 0 and _fits_block(v, c)), f">= 0 (0 = num_draft_tokens); {fits}"),
    }



def default_mask(tok, hf_mode: bool) -> int | None:
    """The MASK id --mask_token_id=-1 means: the tokenizer's mask token; else, outside HF mode, the task's pad (the
    built-in task's reserved <pad>); None in HF mode without a mask token (drafters.mask_token_id names the flag)."""
    mask = getattr(tok, "mask_id", None)
    if mask is not None:
        return int(mask)
    return None if hf_mode else int(tok.pad_id)


def emits(tok, i: int) -> bool:
    """Can the policy emit id i (tok: its task's tokenizer)? Yes for an EOS id (any of tok.eos_ids, the pad too where
    it is one, HF's fallback) and for an id the tokenizer writes as text (decode([i]) is not empty: the built-in
    task's digits and signs, an HF checkpoint's ordinary tokens); no for a special token that ends nothing (the
    built-in <pad> and <bos>, an HF mask token: they decode to nothing) and an id past the tokenizer's vocabulary."""
    return i in tok.eos_ids or (0 <= i < tok.vocab_size and tok.decode([i]) != "")


def _task_tok(c):
    """The run's tokenizer, read without building the run: the HF checkpoint's, else the --task task's; None when it
    cannot be read (then the rows of --model, --data or --task say why, or the build does)."""
    try:
        if c.hf_mode:
            from tasks.hf_task import HFTokenizer
            return HFTokenizer(c.model)
        from tasks.protocol import make_task
        return make_task(c.task, c).tok
    except Exception:  # noqa: BLE001 -- a peek: whatever went wrong is reported where the input is checked
        return None


def _mask_ok(v: int, c) -> bool:
    """--mask_token_id: >= -1, and with a block drafter that drafts (not --no_spec) the id it resolves to (-1:
    default_mask) is one the policy never emits (`emits`) and, outside HF mode (where the checkpoint's embedding
    may be larger than its tokenizer), inside the task's vocabulary."""
    if v < -1:
        return False
    if _kind(c) != "block" or c.no_spec:
        return True
    tok = _task_tok(c)
    i = None if tok is None else v if v >= 0 else default_mask(tok, c.hf_mode)
    if i is None:
        return True  # unreadable here, or HF mode without a mask token: drafters.mask_token_id names the flag
    return (c.hf_mode or i < tok.vocab_size) and not emits(tok, i)


def mask_row(families: dict) -> tuple:
    """--mask_token_id's row: _mask_ok, and its rule naming the block families."""
    names = " or ".join(n for n, _ in _blocks(families))
    return (_mask_ok, f"-1 (the tokenizer's mask token, else the task's pad) or an id >= 0; with --drafter {names} "
                      "one the policy never emits: no EOS id, no id the task's tokenizer writes as text (the "
                      "built-in task's: 0 <pad> or 1 <bos>), inside the task's vocabulary")


_TYPE_CHECKS = {
    "int":   ((lambda v, c: isinstance(v, int) and not isinstance(v, bool)), "an integer"),
    "float": ((lambda v, c: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
              "a finite number"),
    "str":   ((lambda v, c: isinstance(v, str)), "a string"),
    "bool":  ((lambda v, c: isinstance(v, bool)), "true or false"),
}


def check_family_flags(c, families: dict):
    """Refuse, in one line, every flag set off its Config default that the run's draft family (c.drafter) does not
    read while another does: `--block_size=8: only --drafter dflash / dspark read it (this run's --drafter is
    eagle3)`. families: harness/drafters.FAMILIES (name -> its .flags). A block draft's block_size, mask_token_id,
    draft_layers and markov_rank taken from --draft (draft_formats.take_from_draft) are its own family's."""
    readers = {}  # flag -> the families that read it
    for name, fam in families.items():
        for flag in fam.flags:
            readers.setdefault(flag, []).append(name)
    groups = {}  # the families that read them -> the offending flags, in the Config's order
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        if f.name in readers and c.drafter not in readers[f.name] and v != f.default:
            groups.setdefault(tuple(readers[f.name]), []).append(f"--{f.name}={_show(v)}")
    bad = [f"{', '.join(flags)}: only --drafter {' / '.join(r)} read{'s' * (len(r) == 1)} "
           f"{'them' if len(flags) > 1 else 'it'}" for r, flags in groups.items()]
    if bad:
        raise ValueError(f"{'; '.join(bad)} (this run's --drafter is {c.drafter})")


def _problem(key: str, value, rule, cfg=None) -> str | None:
    test, expect = rule
    if test(value, cfg):
        return None
    return f"--{key}={_show(value)}: expected {expect.format(**vars(cfg)) if cfg is not None else expect}"
