"""The fit check: before any work, the memory plan of this run on this device, and a refusal in one line if it does
not fit.

A run that does not fit ends minutes in: after the checkpoint load, the warm-ups and the first rollout, in an
allocator error that names no flag. Here every rank plans its stage first (harness/memory_model.py: weights,
gradients, optimizer, every copy and draft, the rollout's and the update's peaks) against what it may hold:

    capacity = --device_gib                         when given: try a GPU's memory on any machine
             = the GPU's total memory               on CUDA (torch.cuda.get_device_properties)
             = the host's memory / its local ranks  on the CPU (MemTotal: every rank reads the same number)

and the largest rank over 95% of it (HEADROOM: the plan leaves out the allocator's fragmentation) stops the run in one
line: its stage, its planned GiB, its largest components, and the fewest changes that make the plan fit (tried in
this order, each kept only where it helps: --zero1, --micro_batches, --activation_checkpointing, --draft_vocab,
--rollout_batch). --fit_check=false starts anyway. The
same plan resolves --micro_batches=auto (the fewest micro-batches that fit) and --micro_batch_tokens (the fewest
whose micro-batch holds at most that many tokens per CP rank). Every rank computes the same plan from the same
inputs, so all of them refuse alike, with no collective.

    python train.py --model <Qwen3-8B dir> --data p.jsonl --dtype bf16 --device_gib 79.1   # the refusal, on a CPU
"""
from __future__ import annotations

import dataclasses
import os

import torch

from harness import drafters
from harness import memory_model as mm

GiB = 2 ** 30
HEADROOM = 0.05  # of the capacity kept free: the plan leaves out the caching allocator's fragmentation
HINTS = {  # a component -> what makes it smaller
    "activations": "--micro_batches, --activation_checkpointing", "optimizer": "--zero1", "grads": "--zero1",
    "weights": "--pp", "logits_chunks": "--chunk_mib", "head_buffers": "--draft_vocab",
    "draft_activations": "--micro_batches, --anchors, --draft_layers", "kv_cache": "--rollout_batch",
    "verify_logits": "--rollout_batch, --num_draft_tokens", "reference_forward": "--rollout_batch",
}


def capacity(cfg, device: torch.device) -> tuple:
    """(bytes one rank may hold, what that is) for `device`."""
    if cfg.device_gib > 0:
        return cfg.device_gib * GiB, f"--device_gib={cfg.device_gib:g}"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / local, f"the host's {total / GiB:.1f} GiB over its {local} rank(s)"


def plan_of(cfg, model, mesh_dims: tuple, device: torch.device, max_new_tokens: int) -> list:
    """rank_plan of every stage (stage 0 as global rank 0); --zero1 resolved (zero1_on)."""
    run = make_run(cfg, model, mesh_dims, device, max_new_tokens)
    return [mm.rank_plan(cfg, run, s, rank0=s == 0, max_new_tokens=max_new_tokens) for s in range(run.pp)]


def make_run(cfg, model, mesh_dims: tuple, device: torch.device, max_new_tokens: int) -> mm.Run:
    pp, cp, dp = mesh_dims
    return mm.Run(model, pp=pp, cp=cp, dp=dp, seq=cfg.max_prompt_tokens + max_new_tokens,
                  prompt=cfg.max_prompt_tokens, dtype=run_dtype(cfg, device),
                  gpu=device.type == "cuda" or cfg.device_gib > 0)


def zero1_on(cfg, model, mesh_dims: tuple, device: torch.device, max_new_tokens: int) -> bool:
    """--zero1 as the build applies it (memory_model.resolve_zero1: auto is on where a GPU needs it), against this
    capacity."""
    pp, cp, dp = mesh_dims
    return mm.resolve_zero1(cfg, model, mm.Run(model, pp=pp, cp=cp, dp=dp), device, max_new_tokens,
                            device_bytes=capacity(cfg, device)[0] if device.type == "cuda" else None)


def run_dtype(cfg, device) -> str:
    return {"bf16": "bf16", "fp32": "fp32"}.get(cfg.dtype) or ("bf16" if device.type == "cuda" else "fp32")


def divisors(n: int, lo: int) -> list:
    return [d for d in range(max(lo, 1), n + 1) if n % d == 0]


def sequences_per_update(cfg) -> int:
    return -(-cfg.prompts_per_step * cfg.group_size // cfg.updates)


def check_fit(cfg, model, mesh_dims: tuple, device: torch.device, max_new_tokens: int):
    """The run's Config with --micro_batches resolved (auto, --micro_batch_tokens), after raising ValueError (one
    line) where its largest rank's plan exceeds the capacity and --fit_check is on. --zero1 is planned as the build
    resolves it and returned as given."""
    pp, cp, dp = mesh_dims
    n = sequences_per_update(cfg)
    first = cfg if cfg.micro_batches != "auto" else dataclasses.replace(cfg, micro_batches=divisors(n, dp)[0])
    given, cfg = cfg, dataclasses.replace(cfg, zero1=zero1_on(first, model, mesh_dims, device, max_new_tokens))
    if cfg.micro_batch_tokens > 0:  # the fewest equal micro-batches of at most that many tokens per CP rank
        seq = cfg.max_prompt_tokens + max_new_tokens
        fits = [m for m in divisors(n, dp) if n / m * seq / cp <= cfg.micro_batch_tokens] or [n]
        cfg = dataclasses.replace(cfg, micro_batches=fits[0])
    cap, where = capacity(cfg, device)
    cap *= 1 - HEADROOM
    total = lambda c: max(p["total"] for p in plan_of(c, model, mesh_dims, device, max_new_tokens))  # noqa: E731
    if cfg.micro_batches == "auto":
        cands = divisors(n, dp)
        cfg = dataclasses.replace(cfg, micro_batches=next((m for m in cands if total(dataclasses.replace(
            cfg, micro_batches=m)) <= cap), cands[-1]))
    plans = plan_of(cfg, model, mesh_dims, device, max_new_tokens)
    big = max(range(pp), key=lambda s: plans[s]["total"])
    if plans[big]["total"] <= cap or not cfg.fit_check:
        return dataclasses.replace(cfg, zero1=given.zero1)  # as given: the build resolves it alike
    seq = cfg.max_prompt_tokens + max_new_tokens
    count = ((lambda m: f"--micro_batch_tokens {int(n / m * seq / cp)}") if cfg.micro_batch_tokens > 0 else
             (lambda m: f"--micro_batches {m}"))  # the flag the user sizes micro-batches with
    raise ValueError(refusal(cfg, plans[big], big, cap, where, fixes(cfg, total, cap, n, dp, cp, model, count)))


def fixes(cfg, total, cap: float, n: int, dp: int, cp: int, model, count) -> tuple:
    """(the flags that make the plan fit, its GiB then) or (the flags tried, the least GiB). Greedy, in order: each
    change kept where it lowers the plan; then, once it fits, each kept change undone where the plan still fits
    without it, and the micro-batches brought down to the fewest that fit. count(m): the flag for m micro-batches."""
    kept, c, best = {}, cfg, total(cfg)  # flag name -> (its text, the change)
    steps = []
    if not cfg.zero1 and dp * cp > 1:
        steps.append(("--zero1", "--zero1", dict(zero1=True)))
    steps += [("micro", count(m), dict(micro_batches=m)) for m in divisors(n, dp) if m > cfg.micro_batches]
    steps.append(("--activation_checkpointing", "--activation_checkpointing", dict(activation_checkpointing=True)))
    if "draft_vocab" in drafters.family(cfg.drafter).flags and not cfg.no_spec and cfg.draft_vocab == 0 \
            and model.vocab_size > 32000:  # a family that reads --draft_vocab (EAGLE-3's reduced head)
        steps.append(("--draft_vocab", "--draft_vocab 32000", dict(draft_vocab=32000)))
    b = cfg.rollout_batch
    while b > 1:
        b //= 2
        steps.append(("--rollout_batch", f"--rollout_batch {b}", dict(rollout_batch=b)))
    for name, text, change in steps:
        if best <= cap:
            break
        trial = _changed(c, change)
        if trial is not None and (t := total(trial)) < best:
            kept[name], c, best = (text, change), trial, t
    if best <= cap:  # the fewest changes: undo what is not needed, then the fewest micro-batches
        for name in [k for k in kept if k != "micro"]:
            without = _apply(cfg, [ch for k, (_, ch) in kept.items() if k != name])
            if without is not None and total(without) <= cap:
                del kept[name]
        if "micro" in kept:
            others = [ch for k, (_, ch) in kept.items() if k != "micro"]
            m = next(m for m in divisors(n, dp) if m >= cfg.micro_batches and (t := _apply(
                cfg, others + [dict(micro_batches=m)])) is not None and total(t) <= cap)
            kept["micro"] = (count(m), dict(micro_batches=m))
        best = total(_apply(cfg, [ch for _, ch in kept.values()]))
    return [text for text, _ in kept.values()], best


def _changed(c, change: dict):
    try:
        return dataclasses.replace(c, **change)
    except ValueError:  # a combination the run refuses
        return None


def _apply(cfg, changes: list):
    for change in changes:
        cfg = _changed(cfg, change) if cfg is not None else None
    return cfg


def refusal(cfg, plan: dict, stage: int, cap: float, where: str, fix: tuple) -> str:
    """The one line: the rank, its plan against its capacity, the three largest components with what sizes them,
    and the flags that fit (or that nothing tried does)."""
    parts = {k: v for k, v in plan.items() if not k.endswith("_peak") and k not in ("persistent", "total")}
    top = sorted(parts, key=parts.get, reverse=True)[:3]
    hints = list(dict.fromkeys(h for h in (HINTS.get(k) or draft_hint(cfg, k) for k in top) if h))
    flags, best = fix
    then = (f"with {' '.join(flags)} it plans {best / GiB:.1f} GiB" if best <= cap else
            f"none of --zero1, --micro_batches, --activation_checkpointing, --draft_vocab, --rollout_batch fits "
            f"({best / GiB:.1f} GiB at best): a smaller draft or model, or more GPUs (--pp, --cp)")
    return (f"fit check: a rank of pipeline stage {stage} plans {plan['total'] / GiB:.1f} GiB, over the "
            f"{cap / GiB:.1f} GiB it may hold ({where}, {HEADROOM:.0%} kept free); largest: "
            + ", ".join(f"{k} {parts[k] / GiB:.1f}" for k in top) + " GiB"
            + (f" (sized by {'; '.join(hints)})" if hints else "") + f"; {then} (python -m harness.memory_plan "
            "shows the plan; --fit_check=false starts anyway)")


def draft_hint(cfg, component: str) -> str:
    """What sizes a draft arm's copy (copy:<arm>) or the drafts' optimizer state ('' for other components)."""
    if component in ("copy:policy", "copy:reference") or not (component.startswith("copy:")
                                                               or component == "draft_optim"):
        return ""
    return drafters.family(cfg.drafter).cls.size_flags(cfg)  # its class's (drafter.FAMILY)

def fit(cfg):
    """check_fit for a launch, before its mesh: this process's device (mesh.pick_device), the mesh from torchrun's
    WORLD_SIZE (as mesh.make_mesh derives it), the model's shape (a preset with the task's vocabulary, or an HF
    checkpoint's config.json) and the task's response budget."""
    from harness.experiment import build_task
    from harness.mesh import pick_device
    device, world = pick_device(cfg), int(os.environ.get("WORLD_SIZE", "1"))
    dims = (1, 1, 1) if world == 1 else (cfg.pp, cfg.cp, cfg.dp or max(world // (cfg.pp * cfg.cp), 1))
    tsk = build_task(cfg)
    return check_fit(cfg, model_config(cfg.model, cfg), dims, device, tsk.max_new_tokens)


def model_config(spec: str, cfg):
    """--model as a model.ModelConfig: a preset (with the built-in task's vocabulary), a checkpoint directory or its
    config.json."""
    from harness.experiment import build_task
    from model import PRESETS as MODEL_PRESETS
    from serving.hf_io import config_from_hf, read_json
    if spec in MODEL_PRESETS:
        return dataclasses.replace(MODEL_PRESETS[spec], vocab_size=build_task(cfg).tok.vocab_size)
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--model={spec}: expected a preset ({', '.join(sorted(MODEL_PRESETS))}), an HF checkpoint "
                         "directory or its config.json")
    return config_from_hf(read_json(path), path)
