"""GRPO on speculative rollouts with an online co-trained EAGLE-3 draft -- the experiment, in one process.

Each RL step: sample G responses for each of n prompts with speculative decoding (policy + co-trained draft; lossless,
so they are exact policy samples), score them (task.py), compute group advantages, then `updates` optimisation steps,
each ONE policy forward whose logits feed GRPO and whose taps feed the draft's TTT loss (rl_loop.cotrain_step).
Every `eval_every` steps, on the same held-out prompts, measure the acceptance length of (a) the co-trained draft,
(b) a frozen copy of the warm-up draft and (c) a draft co-trained from a cold start, and the rollout tokens/s with and
without speculation. Before RL: SFT warm-up of the policy and offline warm-up of the draft (warmup.py, cached).

    python train.py                # the default experiment: 30 steps, ~7 min on 2 CPU cores from an empty cache
                                   # (the SFT + draft warm-ups take ~4 min of it and are cached in cache/ for reruns)
    python train.py --preset smoke           # every code path at a small size, ~2.5 min from scratch
    python train.py --cold_start             # the rollout draft starts untrained and is only co-trained online
    python train.py --steps=40 --lr=2e-4 --out runs/mine      # any Config field as --key=value or --key value
    python train.py --model PATH --data prompts.jsonl         # HF mode: an HF checkpoint (Llama / Qwen2 / Qwen3 with its
                                                              # tokenizer.json), {"prompt", "answer"} lines, math reward

Writes to --out (default runs/<name>): metrics.jsonl (one line per step, "kind": "train" | "eval"), summary.json,
train.png (plots.py); with --ckpt_every=N also <out>/ckpt/step_* (checkpoint.py), and --resume continues the latest.

The pieces of a run live in experiment.py (build, rollout, update, evaluate) and the torchrun half in train_dist.py.
Under torchrun (WORLD_SIZE > 1) the same loop runs on a DP x PP x CP mesh (--pp, --cp, --dp; default pp=2, cp=2):
every DP replica generates its share of the prompts with a full policy + draft copy, the update runs through the
pipeline with CP inside each stage and the draft's TTT loss on the last stage (dist_step.py), then every rank refits
its full copy. Only rank 0 evaluates, prints and writes files. Models live on each rank's own GPU when CUDA is present
(--device=auto; experiment.pick_device), else on the CPU.

    torchrun --standalone --nproc_per_node=4 train.py                         # the default run on pp=2 x cp=2, ~7 min
    torchrun --standalone --nproc_per_node=4 train.py --preset smoke          # pp=2 x cp=2, ~2.5 min on 2 CPU cores
    torchrun --standalone --nproc_per_node=4 train.py --pp=1 --cp=2 --dp=2 --micro_batches=2
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from config import Config, parse_args
from experiment import build, check_finite, evaluate, rollout, update
from plots import plot_run
from train_dist import build_distributed, init_distributed, load_ckpt, rollout_distributed, save_ckpt, update_distributed


# ------------------------------------------------------------------------------------------------------ the loop
HEADER = (f"{'step':>4} {'reward':>6} {'acc':>5} {'expl':>5} {'len':>5} {'KL':>6} {'zero':>4} {'clip':>5} "
          f"{'accept':>6} {'tau^':>5} {'tok/s':>6} {'t_roll':>6} {'t_pol':>5} {'t_dft':>5}")


def train(cfg: Config) -> dict:
    """The experiment. Under torchrun (WORLD_SIZE > 1) the update runs on the DP x PP x CP mesh (dist_step.py), every
    DP replica generates its share of the rollouts, and only rank 0 evaluates, prints and writes files."""
    from tqdm import tqdm
    torch.set_num_threads(cfg.threads)
    d = init_distributed(cfg) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    main = d is None or d.rank == 0
    print_ = print if main else (lambda *a, **k: None)
    tqdm_write = tqdm.write if main else print_
    out_dir = cfg.out or os.path.join("runs", cfg.name)
    if main:
        os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    s = build(cfg, log=print) if d is None else build_distributed(cfg, d, log=print_)
    dev = next(s.policy.parameters()).device
    if d is not None:
        g = d.grid
        print_(f"mesh: dp={g.dp} x pp={g.pp} x cp={g.cp} = {d.world} ranks, models on {dev.type} "
               f"({'NCCL' if dev.type == 'cuda' else 'gloo'}), {cfg.schedule} over layers {d.cotrainer.split}")
    else:
        print_(f"one process, models on {dev}")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    mf = open(metrics_path if main else os.devnull, "w")
    rows, evals = [], []
    last_kl = 0.0
    ckpt_dir, start = os.path.join(out_dir, "ckpt"), 0
    if cfg.resume:
        start, records = load_ckpt(s, d, ckpt_dir)
        for r in records:  # nothing lost, nothing repeated: metrics.jsonl restarts from the checkpoint's records
            (rows if r["kind"] == "train" else evals).append(r)
            mf.write(json.dumps(r) + "\n")
        last_kl = rows[-1]["kl"] if rows else 0.0
        print_(f"resume: {'from step ' + str(start) if start else 'no valid checkpoint in ' + ckpt_dir + ', from 0'}")

    def do_eval(step):
        if not main:  # rank 0 evaluates on its full copy; the others wait at the next step's rollout gather
            return 0.0
        t0 = time.perf_counter()
        ev = {"kind": "eval", "step": step, "kl": last_kl, **evaluate(s)}
        evals.append(ev)
        mf.write(json.dumps(ev) + "\n")
        cold = f" cold {ev['accept_cold']:.2f}" if "accept_cold" in ev else ""
        tqdm_write(f"  eval @ {step}: held-out reward {ev['reward']:.3f} (acc {ev['correct']:.2f}, explicit "
                   f"{ev['explicit']:.2f}) | acceptance co-trained {ev['accept_cotrained']:.2f} frozen "
                   f"{ev['accept_frozen']:.2f}{cold} | spec {ev['tok_s_cotrained']:.0f} vs AR "
                   f"{ev['tok_s_ar']:.0f} tok/s, speedup {ev['speedup']:.2f}x (frozen {ev['speedup_frozen']:.2f}x)")
        return time.perf_counter() - t0

    print_(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    t_eval = do_eval(0) if start == 0 else 0.0
    tqdm_write(HEADER)
    bar = tqdm(range(start, cfg.steps), desc="GRPO", dynamic_ncols=True, leave=False,
               disable=None if main else True)  # off when not a TTY
    for step in bar:
        timer = {"eval": t_eval}
        t0 = time.perf_counter()
        problems = s.task.sample(cfg.prompts_per_step, s.rng)  # same on every rank
        batch, info = rollout(s, problems) if d is None else rollout_distributed(s, d, problems)
        timer["rollout"] = time.perf_counter() - t0
        timer["policy_train"] = 0.0
        timer["draft_train"] = 0.0
        up = update(s, batch, timer) if d is None else update_distributed(s, d, batch, timer)
        check_finite(step + 1, up, s)
        last_kl = up["kl"]
        row = {"kind": "train", "step": step + 1, **info, **up, "time": timer}
        rows.append(row)
        mf.write(json.dumps(row) + "\n")
        mf.flush()
        tqdm_write(f"{step + 1:4d} {info['reward']:6.3f} {info['correct']:5.2f} {info['explicit']:5.2f} "
                   f"{info['resp_len']:5.1f} {up['kl']:6.3f} {info['zero_var_groups']:4d} {up['clip_frac']:5.3f} "
                   f"{info['accept_len']:6.2f} {up['tau_hat_cotrained']:5.2f} {info['rollout_tok_s']:6.0f} "
                   f"{timer['rollout']:6.2f} {timer['policy_train']:5.2f} {timer['draft_train']:5.2f}")
        bar.set_postfix(reward=f"{info['reward']:.2f}", kl=f"{up['kl']:.3f}", accept=f"{info['accept_len']:.2f}")
        t_eval = 0.0
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            t_eval = do_eval(step + 1)
            row["time"]["eval"] = t_eval
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            mf.flush()
            save_ckpt(s, d, ckpt_dir, step + 1, sorted(rows + evals, key=lambda r: (r["step"], r["kind"] == "eval")))
    bar.close()
    mf.close()
    if not main:
        dist.destroy_process_group()
        return {}
    summary = summarize(cfg, rows, evals, s.warm_info, time.perf_counter() - t_start)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_run(rows, evals, os.path.join(out_dir, "train.png"),
             title=f"{cfg.name}: {cfg.steps} GRPO steps, {cfg.prompts_per_step}x{cfg.group_size} rollouts/step")
    print_(json.dumps(summary, indent=2))
    print_(f"wrote {metrics_path}, summary.json, train.png")
    if d is not None:
        dist.destroy_process_group()
    return summary


def summarize(cfg: Config, rows: list, evals: list, warm: dict, wall_s: float) -> dict:
    n = max(1, len(rows) // 10)  # first / last 10% of steps (rollout rewards are noisy step to step)
    first, last = evals[0], evals[-1]
    tsum = {k: sum(r["time"].get(k, 0.0) for r in rows) for k in ("rollout", "policy_train", "draft_train", "eval")}
    out = {"steps": len(rows),
           "reward_first": sum(r["reward"] for r in rows[:n]) / n, "reward_last": sum(r["reward"] for r in rows[-n:]) / n,
           "eval_reward_first": first["reward"], "eval_reward_last": last["reward"],
           "correct_first": first["correct"], "correct_last": last["correct"],
           "explicit_first": first["explicit"], "explicit_last": last["explicit"],
           "kl_last": rows[-1]["kl"],
           "accept_len_cotrained": last["accept_cotrained"], "accept_len_frozen": last["accept_frozen"],
           "accept_len_cotrained_first": first["accept_cotrained"], "accept_len_frozen_first": first["accept_frozen"],
           "rollout_speedup": last["speedup"], "rollout_speedup_frozen": last["speedup_frozen"],
           "spec_tok_s": last["tok_s_cotrained"], "ar_tok_s": last["tok_s_ar"],
           "time_s": {**{k: round(v, 1) for k, v in tsum.items()}, "sft_warmup": round(warm["sft_s"], 1),
                      "draft_warmup": round(warm["draft_warmup_s"], 1)},
           "warmup_cached": {"policy": warm["policy_cached"], "draft": warm["draft_cached"]},
           "cold_start": cfg.cold_start, "wall_s": round(wall_s, 1)}
    if "accept_cold" in last:
        out["accept_len_cold_first"], out["accept_len_cold"] = first["accept_cold"], last["accept_cold"]
    return out


if __name__ == "__main__":
    try:
        config = parse_args(sys.argv[1:])
    except ValueError as e:
        sys.exit(f"train.py: {e}")
    train(config)
