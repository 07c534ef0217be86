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
import difflib
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import task
from experiment import build, check_finite, evaluate, rollout, update
from model import PRESETS as MODEL_PRESETS
from plots import plot_run
from rl_loop import GRPOConfig
from train_dist import build_distributed, init_distributed, load_ckpt, rollout_distributed, save_ckpt, update_distributed


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    threads: int = 1  # 1 is robust on a shared 2-core machine (2 threads spin-wait when cores are busy)
    warmup_threads: int = 2  # the warm-ups run alone (under torchrun on rank 0 while the others wait): use the cores
    device: str = "auto"  # auto: each process's own GPU when CUDA is present and every local rank gets one, else CPU
    out: str = ""  # "" -> runs/<name>
    cache_dir: str = "cache"
    # task (task.py)
    min_steps: int = 4  # chain length range of the count-up problems
    max_steps: int = 7
    p_explicit: float = 0.7  # SFT demos write a step explicitly with this probability (RL raises it towards 1)
    format_weight: float = 0.5  # reward = correct * (1 + format_weight * explicit fraction)
    # policy and SFT warm-up. HF mode: --model=DIR (an HF checkpoint directory: Llama / Qwen2 / Qwen3 + tokenizer.json)
    # with --data=prompts.jsonl: the checkpoint as the policy (no SFT), its tokenizer, a math-answer reward (hf_task.py)
    model: str = "mini"  # model.ModelConfig preset (vocab_size is the task's), or an HF checkpoint directory
    data: str = ""  # HF mode: jsonl with "prompt" and "answer" fields
    eval_fraction: float = 0.1  # HF mode: share of the distinct prompts held out for eval
    max_prompt_tokens: int = 1024  # HF mode: longer prompts are dropped at load time
    max_new_tokens: int = 0  # response budget; 0: the task's own (built-in: its longest well-formed response; HF: 256)
    sft_steps: int = 1000
    sft_batch: int = 64
    sft_lr: float = 1e-2
    # draft and its warm-up
    cold_start: bool = False  # the rollout draft starts untrained (fc/layer random, head copied) and learns online only
    cold_arm: bool = True  # also co-train a cold-start draft on the same taps, evaluated only (no rollouts)
    draft_warmup_steps: int = 800  # 200 x 64 at 1e-3 left it at acceptance ~2.2 (k = 3): speculation lost on CPU
    draft_warmup_batch: int = 32
    draft_warmup_lr: float = 3e-3  # the offline fit; draft_lr is the online co-training's
    draft_warmup_pool: int = 1024
    draft_lr: float = 1e-3  # online co-training during RL
    draft_lam: float = 1.0  # total = L_policy + draft_lam * L_draft
    draft_grad_clip: float = 1.0
    ttt_passes: int = 3
    # RL
    steps: int = 30
    prompts_per_step: int = 32  # 8 prompts x 8 samples per step left the GRPO update mostly noise
    group_size: int = 8
    temperature: float = 1.0
    num_draft_tokens: int = 3
    rollout_batch: int = 32  # rows per generate call (the rollout engine's batch), speculative and autoregressive alike
    lr: float = 3e-4
    grad_clip: float = 1.0
    updates: int = 2  # optimisation steps per rollout batch (minibatches), old log-probs from the rollout
    micro_batches: int = 1  # gradient accumulation inside one update
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0  # k3 KL penalty to the frozen reference (0: drift is measured, not penalised)
    std_norm: bool = True
    loss_norm: str = "global-token"
    # eval
    eval_every: int = 10
    eval_prompts: int = 64
    eval_samples: int = 2  # samples per eval prompt (same seed for every arm)
    # distributed (torchrun, WORLD_SIZE > 1 only): mesh DP x PP x CP, pp * cp * dp = world size (dp=0: world/(pp*cp))
    pp: int = 2
    cp: int = 2
    dp: int = 0
    schedule: str = "1f1b"  # pipeline.SCHEDULES
    # checkpoints (checkpoint.py): every ckpt_every steps into <out>/ckpt (0: never); --resume continues the latest
    ckpt_every: int = 0
    resume: bool = False
    dist_timeout: int = 1800  # seconds any collective may wait (a dead or stuck rank fails the job instead of hanging)

    def __post_init__(self):
        checks = [("steps", self.steps >= 1), ("group_size", self.group_size >= 2), ("updates", self.updates >= 1),
                  ("micro_batches", self.micro_batches >= 1), ("num_draft_tokens", self.num_draft_tokens >= 1),
                  ("eval_every", self.eval_every >= 1), ("prompts_per_step", self.prompts_per_step >= 1),
                  ("temperature", self.temperature > 0), ("ttt_passes", self.ttt_passes >= 1),
                  ("threads", self.threads >= 1), ("warmup_threads", self.warmup_threads >= 1),
                  ("rollout_batch", self.rollout_batch >= 1), ("device", self.device in ("auto", "cpu", "cuda")),
                  ("updates", self.updates <= self.prompts_per_step * self.group_size),
                  ("pp", self.pp >= 1), ("cp", self.cp >= 1), ("dp", self.dp >= 0),
                  ("schedule", self.schedule in ("afab", "1f1b")), ("dist_timeout", self.dist_timeout >= 1),
                  ("ckpt_every", self.ckpt_every >= 0), ("max_new_tokens", self.max_new_tokens >= 0),
                  ("eval_fraction", 0 < self.eval_fraction < 1), ("max_prompt_tokens", self.max_prompt_tokens >= 1),
                  ("sft_steps", self.sft_steps >= 1), ("draft_warmup_steps", self.draft_warmup_steps >= 0),
                  ("draft_warmup_lr", self.draft_warmup_lr > 0), ("draft_lr", self.draft_lr > 0),
                  ("draft_warmup_batch", 1 <= self.draft_warmup_batch <= self.draft_warmup_pool)]
        for key, ok in checks:
            if not ok:
                raise ValueError(f"{key}={getattr(self, key)!r} is out of range")
        GRPOConfig(loss_norm=self.loss_norm, eps_low=self.eps_low, eps_high=self.eps_high)  # validates those keys
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': CUDA is not available here (use --device=auto or --device=cpu)")
        if self.hf_mode:
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"model={self.model!r}: the directory has no config.json (expected an HF checkpoint)")
            if not self.data:
                raise ValueError(f"model={self.model!r} is an HF checkpoint: HF mode needs --data=prompts.jsonl "
                                 "(one {\"prompt\": ..., \"answer\": ...} per line)")
            if not os.path.isfile(self.data):
                raise ValueError(f"data={self.data!r}: no such file (expected jsonl with 'prompt' and 'answer')")
        else:
            if self.model not in MODEL_PRESETS:
                raise ValueError(f"model={self.model!r}: expected a preset {sorted(MODEL_PRESETS)} or an HF checkpoint "
                                 "directory")
            if self.data:
                raise ValueError(f"data={self.data!r}: prompts from a file need --model=<HF checkpoint directory> "
                                 "(the built-in task generates its own)")
            task.ProblemSource(self.min_steps, self.max_steps)

    @property
    def hf_mode(self) -> bool:
        """--model names a directory (an HF checkpoint) rather than a model.ModelConfig preset."""
        return self.model not in MODEL_PRESETS and os.path.isdir(self.model)


PRESETS = {
    # ~7 min under torchrun on 2 cores from an empty cache (warm-ups ~4.2 min). The mini model learns the additions in
    # 1000 SFT steps when 70% of the demo steps are explicit (the operands sit side by side), which still leaves RL
    # a format term to raise; 32 prompts per step keep the GRPO update above the noise (8 x 8 samples did not).
    "default": {},
    # the first session's default: the 1.1M small model, a longer drift, and speculative rollouts that pay on CPU once
    # acceptance nears 3 (1.24x at the end); 60 steps, ~5 min of RL + ~15 min of warm-ups on 2 cores
    "small": dict(name="small", model="small", p_explicit=0.3, sft_steps=1200, sft_lr=3e-3, steps=60,
                  prompts_per_step=16, rollout_batch=16, lr=2e-4, eval_prompts=32, draft_warmup_steps=200,
                  draft_warmup_batch=64, draft_warmup_lr=1e-3),
    # CI-sized: every code path and a visible learning signal, ~2.5 min on 2 cores from an empty cache
    # (tests/test_train_torchrun.py)
    "smoke": dict(name="smoke", model="tiny", sft_steps=800, draft_warmup_steps=60, draft_warmup_batch=64,
                  draft_warmup_lr=1e-3, draft_warmup_pool=256, steps=20, rollout_batch=64, eval_prompts=16, max_steps=5),
    # for tests: seconds
    "test": dict(name="test", model="tiny", sft_steps=3, sft_batch=8, draft_warmup_steps=2, draft_warmup_batch=4,
                 draft_warmup_pool=8, steps=2, prompts_per_step=2, group_size=4, eval_every=1, eval_prompts=2,
                 eval_samples=2, min_steps=1, max_steps=2, micro_batches=2),
}


def parse_args(argv: list) -> Config:
    """--preset NAME, --flag (a bool set to true), and --key=value or --key value for any Config field (type-checked)."""
    kv, i, preset = {}, 0, "default"
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--"):
            raise ValueError(f"argument {a!r}: expected --key=value")
        key, eq, val = a[2:].partition("=")
        i += 1
        if key not in types and key != "preset":
            near = difflib.get_close_matches(key, list(types) + ["preset"], n=1)
            raise ValueError(f"unknown config key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        typ = types.get(key, "str")
        if not eq and typ != "bool":  # --key value
            if i >= len(argv) or argv[i].startswith("--"):
                raise ValueError(f"--{key}: expected --{key}=<{typ}> or --{key} <{typ}>")
            val, eq = argv[i], "="
            i += 1
        if key == "preset":
            if val not in PRESETS:
                raise ValueError(f"--preset={val!r}: expected one of {sorted(PRESETS)}")
            preset = val
            continue
        if not eq:
            val = "true"
        kv[key] = _convert(key, val, types[key])
    return Config(**{**PRESETS[preset], **kv})


def _convert(key: str, val: str, typ: str):
    try:
        if typ == "bool":
            if val.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return val.lower() in ("true", "1")
        return {"int": int, "float": float, "str": str}[typ](val)
    except ValueError:
        raise ValueError(f"--{key}={val!r}: expected a value of type {typ}") from None


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
