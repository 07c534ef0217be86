"""The memory plan: before launching, what each rank of a run would hold, per component, and whether it fits.

    python -m harness.memory_plan --model docs/examples/qwen3_8b/config.json --gpus 8 --pp 2 --cp 2 --seq 32768 \\
        --rollout_batch 64 --max_new_tokens 8192 --dtype bf16 [--zero1] [--activation_checkpointing] [--device_gib 79.1]

--model: a preset (mini, small, tiny: the built-in task's vocabulary), an HF checkpoint directory or its config.json.
Every other train.py flag is read as the run reads it (harness/config.py: --prompts_per_step, --group_size, --updates,
--micro_batches, --num_draft_tokens, --cold_arm, --offline_arm, --chunk_mib, ...). The plan's own flags: --gpus
(the world size, default pp x cp x dp; dp = gpus / (pp cp) unless --dp), --seq (tokens per sequence, prompt +
response; default --max_prompt_tokens + --max_new_tokens), --device_gib (GiB per device as torch reports it, default
79.1: an "80 GB" H100's torch.cuda.get_device_properties().total_memory; an H200 "141 GB" has ~139.8) and
--recommend (also list the meshes -- pp, cp, dp, --zero1, --activation_checkpointing -- that fit, each at the largest
--rollout_batch that does). --dtype auto is bf16 here (the plan is for GPUs); --zero1=auto is resolved as a run on
CUDA resolves it (memory_model.resolve_zero1), against --device_gib.

It prints one column per pipeline stage (the stage's ranks are alike; rank 0, on stage 0, also trains the offline
arm): the components of harness/memory_model.py (its docstring says what each one counts), each phase's peak and the
total, persistent + the larger phase. A model of memory, not a measurement: tests/test_memory_plan.py checks it
against the tensors a real step allocates (harness/memory_track.py) on small configs. The CUDA context and NCCL's
buffers are stated constants (memory_model.CUDA_CONTEXT_GIB, NCCL_GIB_PER_GROUP), not measurements.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from harness import memory_model as mm
from harness.fit_check import check_fit, model_config
from harness.config import Config, help_text, parse_args
from model import PRESETS as MODEL_PRESETS
from model import check_tap_layers
from parallel.cli import print_help, run_main, wants_help

GiB = 2 ** 30
USAGE = ("usage: python -m harness.memory_plan [--model PRESET|DIR|config.json] [--gpus N] [--seq T] "
         "[--device_gib G] [--recommend] [train.py flags]")
OWN = {"gpus": int, "seq": int, "device_gib": float, "recommend": bool}


def parse(argv: list) -> tuple:
    """-> (Config, model spec, own flags). The plan's own flags and --model are taken out; the rest is train.py's."""
    own, rest, i = {"gpus": 0, "seq": 0, "device_gib": 79.1, "recommend": False}, [], 0
    while i < len(argv):
        key, eq, val = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if key in OWN or key in ("model", "tap_layers"):
            if not eq and OWN.get(key) is not bool:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key}: expected a value")
                val, i = argv[i + 1], i + 1
            elif not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):  # --recommend true
                val, i = argv[i + 1], i + 1
            try:
                if OWN.get(key) is bool and val.lower() not in ("", "1", "true", "0", "false"):
                    raise ValueError
                v = (val.lower() in ("", "1", "true")) if OWN.get(key) is bool else OWN.get(key, str)(val)
            except ValueError:
                what = "true or false" if OWN.get(key) is bool else f"a value of type {OWN[key].__name__}"
                raise ValueError(f"--{key}={val!r}: expected {what}") from None
            if key in ("model", "tap_layers"):  # checked against --model below, not Config's default preset
                own[key] = v
            else:
                own[key] = v
        else:
            rest.append(argv[i])
        i += 1
    bad = [f"--{k}={own[k]:g}: expected {want}" for k, ok, want in (
        ("gpus", own["gpus"] >= 0, ">= 0 (0: pp x cp x dp)"), ("seq", own["seq"] >= 0, ">= 0 (0: --max_prompt_tokens "
         "+ --max_new_tokens)"), ("device_gib", 0 < own["device_gib"] < float("inf"), "a finite number > 0")) if not ok]
    if bad:
        raise ValueError("; ".join(bad))
    spec = own.pop("model", "mini")
    cfg = parse_args(rest + ([f"--model={spec}"] if spec in MODEL_PRESETS else []))
    if spec not in MODEL_PRESETS:  # a checkpoint: the arms' auto is HF mode's (off), as Config.arm reads it there
        cfg = dataclasses.replace(cfg, **{f: False for f in ("frozen_arm", "cold_arm", "offline_arm", "log_kl")
                                          if getattr(cfg, f) == "auto"})
    try:  # ids of --model's layers, checked once the model is read (Config's check reads its default preset)
        own["tap_layers"] = tuple(int(t) for t in own.get("tap_layers", "").split(",") if t.strip())
    except ValueError:
        raise ValueError("--tap_layers: expected comma-separated layer ids, e.g. --tap_layers=1,17,32") from None
    return cfg, spec, own


def make_run(cfg: Config, m, own: dict) -> mm.Run:
    """The mesh and lengths of the plan, checked like harness/mesh.make_mesh checks a launch."""
    gpus = own["gpus"] or cfg.pp * cfg.cp * max(cfg.dp, 1)  # 0: the mesh's own size
    dp = cfg.dp or gpus // (cfg.pp * cfg.cp)
    if dp < 1 or cfg.pp * cfg.cp * dp != gpus:
        raise ValueError(f"--gpus={gpus}: expected pp x cp x dp = {cfg.pp} x {cfg.cp} x {cfg.dp or 'dp'} GPUs; set "
                         "--pp, --cp, --dp so that their product is the number of GPUs")
    new = cfg.max_new_tokens
    seq = own["seq"] or cfg.max_prompt_tokens + (new or 256)
    if not 0 < (new or 256) < seq:
        raise ValueError(f"--seq={seq}: expected more tokens than --max_new_tokens={new or 256} (a prompt and a "
                         "response)")
    return mm.Run(m, pp=cfg.pp, cp=cfg.cp, dp=dp, seq=seq, prompt=seq - (new or 256),
                  dtype="fp32" if cfg.dtype == "fp32" else "bf16", tap_layers=own.get("tap_layers", ()), gpu=True)


def plan(cfg: Config, run: mm.Run) -> list:
    """rank_plan of each stage (stage 0 as global rank 0)."""
    return [mm.rank_plan(cfg, run, s, rank0=s == 0) for s in range(run.pp)]


def show(nbytes: float) -> str:
    return f"{nbytes / GiB:9.2f}" if nbytes else "        -"


def table(cfg: Config, run: mm.Run, plans: list, device_gib: float) -> str:
    """The per-stage table, GiB per rank."""
    head = (f"memory plan (a model, not a measurement): {run.model.architecture} "
            f"{run.model.num_hidden_layers} layers, H {run.model.hidden_size}, V {run.model.vocab_size}; "
            f"pp {run.pp} x cp {run.cp} x dp {run.dp}, {run.dtype}, seq {run.seq}, rollout_batch {cfg.rollout_batch}, "
            f"k {mm.draft_tokens(cfg)}, zero1 {cfg.zero1}, activation_checkpointing {cfg.activation_checkpointing}")
    rows = [head, f"{'GiB per rank':22s}" + "".join(f"  stage {s:<3d}" for s in range(run.pp))]
    for key in plans[0]:
        rows.append(f"{key:22s}" + "".join(f"  {show(p[key])}" for p in plans))
    worst = max(p["total"] for p in plans)
    verdict = "fits" if worst <= device_gib * GiB else "does NOT fit"
    rows.append(f"largest rank: {worst / GiB:.2f} GiB of {device_gib:g} GiB: {verdict}")
    return "\n".join(rows)


def candidates(cfg: Config, m, own: dict) -> list:
    """(largest rank's total, Config, Run) of every mesh and sharding over --gpus that the run accepts."""
    g, out = own["gpus"] or cfg.pp * cfg.cp * max(cfg.dp, 1), []
    for pp in [d for d in range(1, g + 1) if g % d == 0 and d <= m.num_hidden_layers]:
        for cp in [d for d in range(1, g // pp + 1) if (g // pp) % d == 0]:
            dp = g // (pp * cp)
            for zero1 in (False, True) if dp * cp > 1 else (False,):
                for ac in (False, True):
                    try:
                        c = dataclasses.replace(cfg, pp=pp, cp=cp, dp=dp, zero1=zero1, activation_checkpointing=ac,
                                                micro_batches=max(cfg.micro_batches, dp))
                    except ValueError:  # e.g. micro_batches does not divide the update: the run would refuse it
                        continue
                    run = make_run(c, m, own)
                    out.append((max(p["total"] for p in plan(c, run)), c, run))
    return sorted(out, key=lambda t: (t[1].zero1, t[1].activation_checkpointing, t[0]))


def recommend(cfg: Config, m, own: dict, top: int = 6) -> str:
    """The meshes that fit, each at the largest --rollout_batch (--rollout_batch halved until it fits): the largest
    batch first, then fewest changes (no ZeRO-1, no checkpointing), then the smallest total."""
    cap, fit, cands, best = own["device_gib"] * GiB, [], candidates(cfg, m, own), None
    for total, c, run in cands:
        while total > cap and c.rollout_batch > 1:
            c = dataclasses.replace(c, rollout_batch=c.rollout_batch // 2)
            total = max(p["total"] for p in plan(c, run))
        if total <= cap:
            fit.append((-c.rollout_batch, c.zero1, c.activation_checkpointing, total, c))
        if best is None or total < best[0]:
            best = (total, c, run)
    gpus = own["gpus"] or cfg.pp * cfg.cp * max(cfg.dp, 1)
    lines = [f"recommend ({gpus} GPUs of {own['device_gib']:g} GiB): {len(fit)} of {len(cands)} meshes fit "
             f"at some --rollout_batch <= {cfg.rollout_batch}"]
    for *_, total, c in sorted(fit, key=lambda t: t[:4])[:top]:
        lines.append(f"  pp {c.pp} cp {c.cp} dp {c.dp} zero1 {c.zero1} activation_checkpointing "
                     f"{c.activation_checkpointing} micro_batches {c.micro_batches} rollout_batch {c.rollout_batch}: "
                     f"{total / GiB:.1f} GiB")
    if not fit:
        total, c, run = best
        worst = max(plan(c, run), key=lambda p: p["total"])
        big = max((k for k in worst if not k.endswith("_peak") and k not in ("persistent", "total")),
                  key=lambda k: worst[k])
        lines.append(f"  none; the smallest (pp {c.pp} cp {c.cp} dp {c.dp} zero1 {c.zero1} activation_checkpointing "
                     f"{c.activation_checkpointing} rollout_batch {c.rollout_batch}) needs {total / GiB:.1f} GiB "
                     f"({worst['persistent'] / GiB:.1f} persistent), its largest component {big} "
                     f"{worst[big] / GiB:.1f} GiB")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):  # the plan's docstring, then every train.py flag it reads
        print_help(USAGE + "\n\n" + __doc__ + "\n" + help_text(USAGE).split("\n", 1)[1])
        raise SystemExit(0)
    cfg, spec, own = parse(argv)
    m = model_config(spec, cfg)
    taps = own["tap_layers"]
    if taps and len(check_tap_layers(taps, m.num_hidden_layers - 1)) != 3:  # the last layer's output is no tap
        raise ValueError(f"--tap_layers={','.join(map(str, taps))}: expected 3 layer ids (the served format)")
    run = make_run(cfg, m, own)
    zero1 = mm.resolve_zero1(cfg, m, run, "cuda", run.seq - run.prompt, device_bytes=own["device_gib"] * GiB)
    cfg = check_fit(dataclasses.replace(cfg, zero1=zero1, device_gib=own["device_gib"], fit_check=False,
                                        max_prompt_tokens=run.prompt),  # --micro_batches auto, --micro_batch_tokens
                    m, (run.pp, run.cp, run.dp), torch.device("cpu"), run.seq - run.prompt)
    print(table(cfg, run, plan(cfg, run), own["device_gib"]))
    if own["recommend"]:
        print(recommend(cfg, m, own))


if __name__ == "__main__":
    run_main(main, __file__)  # an error: one line naming the flag, field or file, exit 1 (COSPEC_TRACEBACK=1: more)
