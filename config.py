"""The run's one typed config: every setting of train.py, its presets, and the command line that overrides them.

    Config()                      the default experiment (a dataclass: every field has its default and a comment)
    PRESETS[name]                 named overrides: "default", "small", "smoke" (CI-sized), "test" (seconds)
    parse_args(argv) -> Config    --preset NAME, --flag, --key=value or --key value; type-checked, unknown keys rejected

    python train.py --preset smoke --steps=10 --lr 1e-4

Loud on mistakes: a value out of range raises ValueError naming the key (Config.__post_init__); a mistyped key gets
the closest real one as a suggestion.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass

import torch

import task
from model import PRESETS as MODEL_PRESETS
from rl_loop import GRPOConfig


@dataclass
class Config:
    name: str = "default"
    seed: int = 0  # the warm-ups (SFT, draft) and the held-out prompts: shared by every rl_seed
    rl_seed: int = -1  # the RL phase (prompts, rollouts, shuffles, cold-start draft, offline arm); -1: = seed
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
    offline_arm: bool = True  # the control: the warm-up draft trained as much, on fresh pi_0 samples (offline_arm.py)
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
    num_draft_tokens: int = 4  # k (rollouts and eval): the ceiling k + 1 = 5 sits above the warm-up draft's ~4
    rollout_batch: int = 32  # rows per generate call (the rollout engine's batch), speculative and autoregressive alike
    lr: float = 1e-3  # the drift: ~3x the old 3e-4, so the policy leaves its SFT style fast (0 = the no-drift control)
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
    eval_draft_tokens: int = 0  # k at eval (0: num_draft_tokens); a larger k keeps the ceiling k + 1 from binding
    bootstrap: int = 2000  # paired bootstrap resamples over eval prompts for the acceptance-gain intervals
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
                  ("draft_warmup_batch", 1 <= self.draft_warmup_batch <= self.draft_warmup_pool),
                  ("rl_seed", self.rl_seed >= -1), ("eval_draft_tokens", self.eval_draft_tokens >= 0),
                  ("bootstrap", self.bootstrap >= 1), ("lr", self.lr >= 0)]
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
    def run_seed(self) -> int:
        """The RL phase's seed: rl_seed, or seed when rl_seed = -1."""
        return self.seed if self.rl_seed < 0 else self.rl_seed

    @property
    def eval_k(self) -> int:
        """Draft tokens per step at eval."""
        return self.eval_draft_tokens or self.num_draft_tokens

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
                  draft_warmup_batch=64, draft_warmup_lr=1e-3, num_draft_tokens=3),
    # CI-sized: every code path and a visible learning signal, ~2.5 min on 2 cores from an empty cache
    # (tests/test_train_torchrun.py)
    "smoke": dict(name="smoke", model="tiny", sft_steps=800, draft_warmup_steps=60, draft_warmup_batch=64,
                  draft_warmup_lr=1e-3, draft_warmup_pool=256, steps=20, rollout_batch=64, eval_prompts=16, max_steps=5,
                  lr=3e-4, num_draft_tokens=3),
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
