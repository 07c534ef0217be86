"""The warm-ups' cache keys: every input a warm-up reads, and the source of the code that computes it.

    spec = PolicySpec.from_config(cfg, tsk)      everything the SFT warm-up reads (warmup.warm_policy takes only it)
    spec = DraftSpec.from_config(cfg, tsk, pk)   everything the draft warm-up reads, pk the policy's key
    spec.key()                                   hash of every field of the spec + code_fingerprint(): no training

A warm-up reads its settings from its spec alone, and the key hashes the whole spec (each field by name), so a setting
added to a spec is in the key without anyone listing it. A task enters by its fingerprint() (everything that shapes
its prompts, demonstrations and rewards, incl. which data rows it holds and how they are split), a ModelConfig by its
fields, a function by its module and name; anything else is refused (TypeError) rather than keyed by a repr that may
hold a memory address. Keys are stable across processes: JSON with sorted keys, no id(), no hash().

The code in the key (code_fingerprint): the source files of harness/warmup.py and of the task's module, and of every
project module they import, transitively (imports under `if __name__ == "__main__":` and `if TYPE_CHECKING:` aside,
as they never run in a warm-up). That is the SFT and draft training code, the model, the draft and its loss, the
sampler, the attention the warm-ups call and the checkpoint format: an edit to any of them retrains the warm-ups,
while an edit to the RL harness (config, experiment, dist_step, pipeline, train.py) does not. Whole files rather
than single functions: a helper a warm-up calls cannot be left out, at the price of retraining after an unrelated
edit to one of these files. So that this is no silent trap, each entry records its settings-only hash and its
files' hashes (code.json), and a miss names the files changed since an entry of the same settings (stale_line).

Left out on purpose: the device, the thread count, --chunk_mib and the ranks that share the work (a warm-up trained
on a CPU serves a GPU run; they change rounding, not what is trained), where the cache lives, and how often progress
is logged. The dtype the warm-up computes in (--dtype; "auto" by the device) is in: bf16 rounds every weight.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from harness import drafters
from model import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_MODULES = ("harness.warmup",)  # the code roots of every warm-up; the task's module is added per spec


# ------------------------------------------------------------------------------------------------------ the hash
def _plain(v, where: str):
    """v as JSON-ready data: a task by its fingerprint(), a dataclass by its fields, a function by its name."""
    if hasattr(v, "fingerprint") and callable(v.fingerprint):
        return _plain(v.fingerprint(), where)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name), f"{where}.{f.name}") for f in dataclasses.fields(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x, f"{where}[{k!r}]") for k, x in v.items()}
    if callable(v) and hasattr(v, "__module__") and hasattr(v, "__qualname__"):
        return f"{v.__module__}.{v.__qualname__}"
    raise TypeError(f"cache_key: {where} is a {type(v).__name__}; expected JSON data (str keys), a dataclass, a "
                    "function or an object with fingerprint() -> dict (a repr would not be stable across processes)")


def cache_key(*parts) -> str:
    """A short stable hash of settings: JSON data, dataclasses, functions, objects with fingerprint()."""
    blob = json.dumps([_plain(p, f"part {i}") for i, p in enumerate(parts)], sort_keys=True, allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def fingerprint(path: str) -> list:
    """(name, size, mtime) of a file or of every file under a directory: a cheap cache key for an HF checkpoint (changes
    when any file is rewritten), without hashing gigabytes of weights."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.abspath(path), st.st_size, st.st_mtime_ns]]
    return [[os.path.relpath(os.path.join(r, f), path), os.path.getsize(os.path.join(r, f)),
             os.stat(os.path.join(r, f)).st_mtime_ns]
            for r, _, files in sorted(os.walk(path)) for f in sorted(files)] + [[os.path.abspath(path)]]


# ------------------------------------------------------------------------------------------------------ the code
def module_path(name: str) -> str | None:
    """The file of a project module (dotted name), or None when it is not one of the checkout's."""
    base = os.path.join(ROOT, *name.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(p):
            return p
    return None


def module_source(path: str) -> str:
    """The text of a source file, as the code fingerprint reads it."""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _runs(node) -> bool:
    """False for `if __name__ == "__main__":` and `if TYPE_CHECKING:` blocks: their imports never run in a warm-up."""
    if not isinstance(node, ast.If):
        return True
    src = ast.unparse(node.test)
    return "__main__" not in src and "TYPE_CHECKING" not in src


@functools.lru_cache(maxsize=512)
def _imports(source: str) -> frozenset:
    """Project modules a source file imports (at any depth of its statements) outside its __main__ / TYPE_CHECKING
    blocks. Cached by the text itself: a changed file is parsed afresh."""
    out, todo = set(), [n for n in ast.parse(source).body if _runs(n)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        for block in ("body", "orelse", "finalbody", "handlers"):  # statements only: imports are never expressions
            todo += [n for n in getattr(node, block, ()) if isinstance(n, (ast.stmt, ast.excepthandler)) and _runs(n)]
    return frozenset(m for m in out if module_path(m))


def code_files(roots) -> list[str]:
    """The checkout-relative paths of `roots` (dotted module names) and of every project module they import,
    transitively; sorted."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        path = module_path(name)
        if path is None:
            raise ValueError(f"code_files: roots={list(roots)!r}: {name!r} is not a module of the checkout {ROOT}")
        if path in seen:
            continue
        seen.add(path)
        todo += sorted(_imports(module_source(path)))
    return sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for p in seen)


def code_fingerprint(roots) -> str:
    """sha256 over (path, source) of code_files(roots): changes when any of that code does."""
    h = hashlib.sha256()
    for rel in code_files(roots):
        h.update(rel.encode() + b"\0" + module_source(os.path.join(ROOT, rel)).encode() + b"\0")
    return h.hexdigest()


def spec_key(kind: str, spec) -> str:
    """The cache key of a warm-up spec: every field by name, and the code of the warm-up and of the spec's task."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return cache_key(kind, fields, code_fingerprint(WARMUP_MODULES + (type(spec.task).__module__,)))


# ------------------------------------------------------------------------------ why a warm-up missed its cache
CODE_RECORD = "code.json"  # beside a cached entry's files: {"settings": settings hash, "code": {path: sha256}}


def code_hashes(spec) -> dict:
    """{checkout-relative path: sha256 of its source} over the code a spec's key hashes."""
    return {rel: hashlib.sha256(module_source(os.path.join(ROOT, rel)).encode()).hexdigest()
            for rel in code_files(WARMUP_MODULES + (type(spec.task).__module__,))}


def settings_key(kind: str, spec, cache_dir: str) -> str:
    """The key of a spec's settings without its code. A draft's policy_key (which holds the policy's code) enters as
    the policy entry's own settings hash when that entry records one."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if "policy_key" in fields:
        rec = read_record(os.path.join(cache_dir, f"policy-{fields['policy_key']}"))
        fields["policy_key"] = rec["settings"] if rec else fields["policy_key"]
    return cache_key(kind, fields)


def code_record(kind: str, spec, cache_dir: str) -> dict:
    """What an entry records of how it was built (written beside it as CODE_RECORD)."""
    return {"settings": settings_key(kind, spec, cache_dir), "code": code_hashes(spec)}


def write_record(entry: str, rec: dict):
    """Write an entry's CODE_RECORD (into the entry's temporary directory, before it is published)."""
    with open(os.path.join(entry, CODE_RECORD), "w", encoding="utf-8") as f:
        json.dump(rec, f, sort_keys=True, indent=1)


def read_record(entry: str) -> dict | None:
    """An entry's CODE_RECORD, or None (an entry cached before records were kept, or an unreadable one)."""
    try:
        with open(os.path.join(entry, CODE_RECORD), encoding="utf-8") as f:
            rec = json.load(f)
        return rec if isinstance(rec.get("settings"), str) and isinstance(rec.get("code"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def stale_line(label: str, kind: str, spec, cache_dir: str) -> str | None:
    """On a cache miss: one line naming the source files changed since a cached entry of the same settings, e.g.
    "policy SFT warm-up: retraining: model.py, draft.py changed since cache/policy-<key>"; None when no entry of
    these settings records its code (the settings changed, or the entry predates the records)."""
    want, now = settings_key(kind, spec, cache_dir), code_hashes(spec)
    best = None
    for name in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else ():
        rec = read_record(os.path.join(cache_dir, name)) if name.startswith(f"{kind}-") and "." not in name else None
        if rec and rec["settings"] == want:
            diff = sorted(p for p in set(now) | set(rec["code"]) if now.get(p) != rec["code"].get(p))
            if diff and (best is None or len(diff) < len(best[1])):
                best = (name, diff)
    if best is None:
        return None
    return f"{label}: retraining: {', '.join(best[1])} changed since {os.path.join(cache_dir, best[0])}"


# ----------------------------------------------------------------------------------------------------- the specs
@dataclass(frozen=True)
class PolicySpec:
    """Everything the SFT warm-up reads (warmup.warm_policy)."""
    model: ModelConfig  # the policy's architecture (its vocab is the task's)
    task: object  # tasks/protocol.py: its demonstrations (encode_demo; the built-in task's p_explicit with them)
    steps: int
    batch: int
    lr: float
    seed: int  # the initial weights and the demonstrations' sampler
    dtype: str = "float32"  # what it computes in (torch's name): bfloat16 = bf16 with fp32 master weights

    @classmethod
    def from_config(cls, cfg, tsk, device=None) -> PolicySpec:
        return cls(ModelConfig.preset(cfg.model, vocab_size=tsk.tok.vocab_size), tsk, cfg.sft_steps, cfg.sft_batch,
                   cfg.sft_lr, cfg.seed, run_dtype(cfg, device))

    def key(self) -> str:
        return spec_key("policy", self)


@dataclass(frozen=True)
class DraftSpec:
    """Everything the draft warm-up reads (warmup.warm_draft) besides the policy, which policy_key names."""
    policy_key: str  # PolicySpec.key() of the SFT'd policy, or hf_policy_key() of an HF checkpoint
    task: object  # its train prompts and EOS
    steps: int  # 0: an untrained draft (not cached)
    batch: int
    lr: float
    pool: int  # responses sampled from the policy, the warm-up's data
    max_new_tokens: int  # each sampled response's budget
    num_passes: int  # TTT passes
    seed: int
    draft_vocab: int  # N > 0: the draft names only the N most frequent tokens of the sampled responses
    attn_fn: object = None  # the policy's attention in the teacher forward (None: the model's own)
    draft_attn_fn: object = None  # the draft's attention in its TTT passes
    tap_layers: tuple = ()  # the policy layers the draft reads; (): model.default_tap_layers (its code is in the key)
    pass_weight: float = 0.8  # the TTT loss weighs pass d by pass_weight^(d-1)
    rows: int = 256  # prompts per generate call when sampling the pool (--rollout_batch): it shapes the samples
    drafter: str = drafters.DEFAULT  # the draft family (harness/drafters.py)
    drafter_opts: tuple = ()  # its construction and loss options, sorted (key, value) pairs (drafters.options)
    dtype: str = "float32"  # what the policy and the draft compute in (torch's name; bfloat16: fp32 masters)

    @classmethod
    def from_config(cls, cfg, tsk, policy_key: str, *, attn_fn=None, draft_attn_fn=None, device=None) -> DraftSpec:
        return cls(policy_key, tsk, cfg.draft_warmup_steps, cfg.draft_warmup_batch, cfg.draft_warmup_lr,
                   cfg.draft_warmup_pool, tsk.max_new_tokens, cfg.ttt_passes, cfg.seed, cfg.draft_vocab, attn_fn,
                   draft_attn_fn, tuple(cfg.tap_layers), cfg.ttt_decay, cfg.rollout_batch, cfg.drafter,
                   tuple(sorted(drafters.options(cfg, tsk).items())), run_dtype(cfg, device))

    def key(self) -> str:
        return spec_key("draft", self)


def run_dtype(cfg, device=None) -> str:
    """The run's compute dtype by torch's name (--dtype; "auto": bf16 on CUDA, fp32 elsewhere, as mesh.model_dtype)."""
    if cfg.dtype == "auto":
        return "bfloat16" if device is not None and torch.device(device).type == "cuda" else "float32"
    return {"bf16": "bfloat16", "fp32": "float32"}[cfg.dtype]


def hf_policy_key(model_dir: str) -> str:
    """The key of an HF checkpoint used as the policy as is: its files (names, sizes, mtimes). What the draft warm-up
    reads from the task (data, split, template, tokenizer) is in DraftSpec's task."""
    return cache_key("hf", fingerprint(model_dir))
