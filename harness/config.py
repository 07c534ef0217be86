"""The run's one typed config: every setting of train.py, its presets, and the command line that overrides them.

    Config()                      the default experiment (a dataclass: every field has its default and a comment)
    PRESETS[name]                 named overrides (harness/presets.py): "default", "small", "smoke", "test", "gpu"
    parse_args(argv) -> Config    --preset NAME, --flag, --key=value or --key value; type-checked, unknown keys rejected
    help_text(usage) -> str       what --help_all prints: the presets, then every flag by topic (flag_groups.py, the
                                  paper's knobs first) with its default, its CHECKS row and its field comment
                                  (generated: the text cannot drift from the checks); brief=True: what --help prints

    python train.py --preset smoke --steps=10 --lr 1e-4

Loud on mistakes: every field has a row in CHECKS (a range or a choice), and a value outside it raises ValueError
naming the flag, the value and what was expected (`--grad_clip=-1: expected > 0`), all bad fields in one message; a
mistyped key gets the closest real one as a suggestion.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import textwrap
from dataclasses import dataclass

import torch

from harness.logger import BACKENDS, parse_backends
from parallel.cli import HELP_ALL, grouped_help, print_help, wants_help
from parallel.cli import show_value as _show
from harness.config_checks import (_TYPE_CHECKS, AUTO_FLAG, FLAG, _installed, _parses, _problem, _update_sizes,
                                    _writable_dir, above, at_least, backend_problem, check_family_flags, family_rows,
                                    one_of)
from harness.draft_formats import take_from_draft
from harness.drafters import FAMILIES as DRAFTERS
from harness.flag_groups import GROUPS
from harness.presets import PRESETS
from model import PRESETS as MODEL_PRESETS
from parallel.pp_schedule import SCHEDULES
from rl_loop import LOSS_NORMS, GRPOKnobs
from decoding.speculative_tree import Tree
from tasks.hf_reward import REWARD_ROW
from tasks.protocol import TASKS, factory


@dataclass
class Config(GRPOKnobs):  # GRPO's own settings are rl_loop.GRPOKnobs's fields, their comments there
    name: str = "default"  # the run's name: its output goes to runs/<name> unless --out says otherwise
    seed: int = 0  # the warm-ups (SFT, draft) and the held-out prompts: shared by every rl_seed
    rl_seed: int = -1  # the RL phase (prompts, rollouts, shuffles, cold-start draft, offline arm); -1: = seed
    threads: int = 1  # 1 is robust on a shared 2-core machine (2 threads spin-wait when cores are busy)
    warmup_threads: int = 1  # the warm-ups' threads: 2 stall at every barrier beside a busy process (bench_omp_wait)
    device: str = "auto"  # auto: each process's own GPU when CUDA is present (none for a rank: an error), else CPU
    out: str = ""  # "" -> runs/<name>
    cache_dir: str = "cache"  # where the warm-ups are cached, keyed by every input and the code that computes them
    # task (tasks/protocol.py; the built-in one: tasks/task.py)
    task: str = "countup"  # a name in tasks/protocol.TASKS, or module:factory (factory(cfg) -> task); not in HF mode
    min_steps: int = 4  # chain length range of the count-up problems
    max_steps: int = 7  # (upper end of the chain length range)
    p_explicit: float = 0.7  # SFT demos write a step explicitly with this probability (RL raises it towards 1)
    format_weight: float = 0.5  # reward = correct * (1 + format_weight * explicit fraction)
    # policy and SFT warm-up. HF mode: --model=DIR (an HF checkpoint directory: Llama / Qwen2 / Qwen3 + tokenizer.json)
    # with --data=prompts.jsonl: the checkpoint as the policy (no SFT), its tokenizer, a math-answer reward (hf_task.py)
    model: str = "mini"  # model.ModelConfig preset (vocab_size is the task's), or an HF checkpoint directory
    data: str = ""  # HF mode: jsonl or parquet, a prompt and an answer per row (hf_data.py)
    prompt_key: str = "prompt"  # HF mode: the row's prompt field (a string, or a chat: [{"role", "content"}, ...])
    answer_key: str = "answer"  # HF mode: the answer field; a dotted key reaches in (reward_model.ground_truth)
    chat_template: str = ""  # HF mode, chat prompts: "" the checkpoint's template, a file or a Jinja string, or "none"
    reward: str = ""  # HF mode: module:function, f(prompt, response, answer) -> float; "": the math-answer rule
    eval_fraction: float = 0.1  # HF mode: share of the distinct prompts held out for eval
    max_prompt_tokens: int = 1024  # HF mode: longer prompts are dropped at load time
    max_new_tokens: int = 0  # response budget; 0: the task's own (built-in: its longest well-formed response; HF: 256)
    sft_steps: int = 1000  # optimisation steps of the policy's SFT warm-up on the task's demonstrations
    sft_batch: int = 64  # demonstrations per SFT step
    sft_lr: float = 1e-2  # AdamW learning rate of the SFT warm-up
    # draft and its warm-up
    cold_start: bool = False  # the rollout draft starts untrained (fc/layer random, head copied) and learns online only
    draft: str = ""  # start from this EAGLE-3 draft (the export's format, e.g. <out>/draft of a run) with no warm-up
    no_spec: bool = False  # plain GRPO: autoregressive rollouts, no draft (no warm-up, arms, co-training); the baseline
    frozen_arm: bool | str = "auto"  # the control: a frozen copy of the warm-up draft (auto: on built-in, off in HF)
    cold_arm: bool | str = "auto"  # also co-train a cold-start draft on the same taps, evaluated only (auto: as above)
    offline_arm: bool | str = "auto"  # the control: the warm-up draft trained as much on fresh pi_0 samples (as above)
    log_kl: bool | str = "auto"  # keep the frozen reference pi_0 to log KL(pi_t || pi_0) per step (auto: as above)
    draft_every: int = 2  # the drafts train on every n-th policy update only (budget 1/n; the offline arm's alike)
    draft_warmup_steps: int = 800  # optimisation steps of the draft warm-up on the warm policy's own samples
    draft_warmup_batch: int = 32  # sequences per draft warm-up step
    draft_warmup_lr: float = 3e-3  # the offline fit; draft_lr is the online co-training's
    draft_warmup_pool: int = 1024  # the warm policy's sampled responses the draft warm-up draws its batches from
    draft_lr: float = 1e-3  # online co-training during RL
    draft_lam: float = 1.0  # total = L_policy + draft_lam * L_draft
    draft_grad_clip: float = 1.0  # gradient-norm clip of every draft's update
    ttt_passes: int = 3  # TTT passes: the draft is unrolled this many steps ahead in training
    ttt_decay: float = 0.8  # the TTT loss weights pass d by ttt_decay^(d-1) (EAGLE-3's 0.8)
    tap_layers: tuple = ()  # the policy layers the draft reads, --tap_layers=0,2,4; (): model.default_tap_layers
    draft_vocab: int = 0  # N > 0: the draft names only the N most frequent response tokens of its warm-up (0 = full)
    drafter: str = "auto"  # the draft family (harness/drafters.py): eagle3 | dflash (a block per forward) | dspark;
    # auto: --draft's family, else eagle3
    block_size: int = 0  # dflash / dspark: W slots per block (0: k + 1; dspark: k); k <= W - 1 drafts (dspark: k <= W)
    anchors: int = 16  # dflash / dspark: training blocks per sequence, at seeded anchors among response positions
    block_gamma: float = 0.0  # dflash / dspark: slot j weighs exp(-(j - 1) / gamma); 0: the rule by W (dspark: W + 1)
    draft_layers: int = 3  # dflash / dspark: the draft's decoder layers (the paper: 5 at 8B)
    mask_token_id: int = -1  # dflash / dspark: the MASK id; -1: the tokenizer's mask token, else the task's pad id
    markov_rank: int = 16  # dspark: the rank of the Markov head (256 at 8B)
    confidence_threshold: float = 0.0  # dspark: a proposal ends before its first slot with confidence below it; 0: off
    # RL
    steps: int = 30  # RL steps (each: rollouts, then `updates` optimisation steps)
    prompts_per_step: int = 32  # prompts per RL step, each sampled group_size times
    group_size: int = 8  # G: samples per prompt, the group of GRPO's advantage
    temperature: float = 1.0  # tau of rollouts, eval and every log-prob of the update (greedy, tau = 0, is not GRPO)
    num_draft_tokens: int | str = 4  # k per verification forward; auto: chosen per step, decoding/adaptive_k.py
    max_draft_tokens: int = 6  # K, the ceiling of --num_draft_tokens=auto (opt-in: samples depend on the clock)
    tree: tuple = ()  # a tree draft (b_1,...,b_k), --tree=2,2,1 (decoding/speculative_tree.py); (): a chain
    rollout_engine: str = "home"  # home: speculative.generate (the reference); vllm: vLLM, refit each step

    rollout_batch: int = 32  # rows per generate call (the rollout engine's batch), speculative and autoregressive alike
    lr: float = 5e-4  # the drift: leaves the SFT style while held-out accuracy rises (0: the no-drift control)
    grad_clip: float = 1.0  # gradient-norm clip of the policy's update
    updates: int = 2  # optimisation steps per rollout batch (minibatches), old log-probs from the rollout
    micro_batches: int | str = 1  # gradient accumulation inside one update; auto: the fewest the memory plan fits
    micro_batch_tokens: int = 0  # > 0: micro_batches = the fewest whose micro-batch holds <= this many tokens per rank
    # eval
    eval_every: int = 10  # steps between held-out evaluations of the draft arms (also at step 0 and the end)
    eval_prompts: int = 64  # held-out prompts per evaluation
    eval_samples: int = 2  # samples per eval prompt (same seed for every arm)
    eval_draft_tokens: int = 0  # k at eval (0: num_draft_tokens; K if auto); a larger k keeps the ceiling k + 1 off
    bootstrap: int = 2000  # paired bootstrap resamples over eval prompts for the acceptance-gain intervals
    # distributed (torchrun, WORLD_SIZE > 1 only): mesh DP x PP x CP, pp * cp * dp = world size (dp=0: world/(pp*cp))
    pp: int = 2  # pipeline stages
    cp: int = 2  # context-parallel ranks inside each stage (zigzag ring)
    dp: int = 0  # data-parallel replicas (0: world size / (pp * cp))
    schedule: str = "1f1b"  # parallel/pp_schedule.SCHEDULES
    activation_checkpointing: bool = False  # recompute each decoder layer in the update's backward (memory for time)
    zero1: bool | str = "auto"  # shard a stage's AdamW m, v, masters over its DP x CP ranks; auto: where the plan needs
    fit_check: bool = True  # refuse to start a run whose memory plan exceeds the device (harness/fit_check.py)
    device_gib: float = 0.0  # GiB each rank may hold, for the fit check (0: the GPU's, or the host's over its ranks)
    # memory and kernels at scale: see docs/memory.md
    attn_backend: str = "auto"  # auto (CUDA: fused triton; CPU: torch, the reference) | torch | triton | flash (CUDA)
    chunk_mib: float = 256.0  # MiB of fp32 logits per chunk of log-probs and draft loss (0: unfused (T, V) logits)
    # precision: bf16 runs every forward (rollouts, reference, drafts, eval) and KV cache in bf16 and keeps the trained
    # weights' fp32 masters, grads and AdamW state (modeling/mixed_precision.py); fp32 allows TF32 matmuls on CUDA
    dtype: str = "auto"  # bf16 | fp32 | auto: bf16 on CUDA, fp32 on the CPU (where bf16 matmuls are far slower)
    # checkpoints (checkpoint.py): every ckpt_every steps into <out>/ckpt (0: never); --resume continues the latest
    ckpt_every: int = 0  # steps between checkpoints into <out>/ckpt (0: never)
    log: str = "jsonl"  # comma list: metrics.jsonl always, plus "tensorboard" (<out>/tb) and/or "wandb" (offline)
    resume: bool = False  # continue the latest checkpoint in <out>/ckpt (the same run only)
    overwrite: bool = False  # a fresh run into an <out> whose ckpt/ holds checkpoints deletes them (resume_policy.py)
    resume_changed_inputs: bool = False  # --resume although --model / --data / --chat_template now hold other bytes
    dist_timeout: int = 1800  # any collective or point-to-point wait (s): > rank 0's uncached warm-ups (train.py)

    def __post_init__(self):
        """Every field against its row of CHECKS (all failures in one error), then the checks across the mode."""
        take_from_draft(self)
        CHECKS.update(family_rows(DRAFTERS))  # the families registered now (a few microseconds)
        types = {f.name: f.type for f in dataclasses.fields(self)}
        bad = [_problem(k, getattr(self, k), _TYPE_CHECKS[t]) for k, t in types.items() if t in _TYPE_CHECKS]
        bad = [e for e in bad if e] or [_problem(k, getattr(self, k), CHECKS[k], self) for k in types if k in CHECKS]
        if any(bad):
            raise ValueError("; ".join(e for e in bad if e))
        check_family_flags(self, DRAFTERS)  # a flag only another draft family reads: one line naming them all
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': CUDA is not available here (use --device=auto or --device=cpu)")
        if self.hf_mode:
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"model={self.model!r}: the directory has no config.json (expected an HF checkpoint)")
            if not self.data:
                raise ValueError(f"model={self.model!r} is an HF checkpoint: HF mode needs --data=prompts.jsonl "
                                 "or .parquet (a prompt and an answer per row)")
            if self.task != "countup":
                raise ValueError(f"--task={self.task}: HF mode (--model={self.model}) takes its task from --data; "
                                 "expected the default --task=countup")
        elif self.data:
            raise ValueError(f"data={self.data!r}: prompts from a file need --model=<HF checkpoint directory> "
                             "(the built-in task generates its own)")

    @property
    def run_seed(self) -> int:
        """The RL phase's seed: rl_seed, or seed when rl_seed = -1."""
        return self.seed if self.rl_seed < 0 else self.rl_seed

    @property
    def eval_k(self) -> int:
        """Draft tokens per step at eval: always a fixed k (with --num_draft_tokens=auto its ceiling)."""
        return self.eval_draft_tokens or (self.max_draft_tokens if self.num_draft_tokens == "auto" else
                                          self.num_draft_tokens)

    @property
    def draft_family(self):
        """The class of the run's draft family (harness/drafters.FAMILIES), None for a --drafter no family has."""
        f = DRAFTERS.get(self.drafter)
        return f.cls if f is not None else None

    @property
    def block_slots(self) -> int:
        """A block drafter's W: block_size, or with block_size = 0 the slots the largest k it drafts (num_draft_tokens,
        eval_draft_tokens) needs, its family's fitted_block(k) (k + 1 for DFlash, whose slot 0 is the anchor; k, at
        least 2, for DSpark, whose every slot drafts); 0 while k is auto (refused) or for a chain drafter."""
        k, cls = self.num_draft_tokens, self.draft_family
        if self.block_size or type(k) is not int or getattr(cls, "kind", None) != "block":
            return self.block_size
        return cls.fitted_block(max(k, self.eval_draft_tokens))

    def attn_backend_on(self, device) -> str:
        """--attn_backend as run on `device`: auto is the fused Triton kernel where the models live on CUDA (the torch
        kernel, a Python loop over tiles, is launch-bound on a GPU; without triton installed, torch), and torch, the
        reference, on CPU. An explicit backend `device` cannot run is a ValueError naming --attn_backend and the device
        (config_checks.backend_problem); mesh.make_mesh asks as soon as the device is known, before any work."""
        device = torch.device(device)
        if self.attn_backend == "auto":
            import importlib.util
            return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
        problem = backend_problem(self, device)
        if problem:
            raise ValueError(f"--attn_backend={self.attn_backend} with the models on {device}: {problem}")
        return self.attn_backend

    def arm(self, name: str) -> bool:
        """Is the control `name` ("frozen", "cold", "offline") or the KL log ("kl") on: its flag, where auto is on in
        the built-in experiment and off in HF mode (a checkpoint's run holds no copy it does not need); never without
        a draft (--no_spec) nor, for the cold arm, when the rollout draft itself starts cold."""
        v = getattr(self, {"kl": "log_kl"}.get(name, f"{name}_arm"))
        on = (not self.hf_mode) if v == "auto" else v
        return on and (name == "kl" or not self.no_spec) and not (name == "cold" and self.cold_start)

    @property
    def needs_ref(self) -> bool:
        """The frozen reference pi_0 is held only when used: the k3 penalty (beta > 0), the offline arm's samples of
        pi_0, or the KL log."""
        return self.beta > 0 or self.arm("offline") or self.arm("kl")

    def trains_drafts(self, update: int) -> bool:
        """The draft-training budget: the drafts train on policy update `update` (0, 1, ... over the run) iff it is a
        multiple of draft_every."""
        return not self.no_spec and update % self.draft_every == 0

    @property
    def hf_mode(self) -> bool:
        """--model names a directory (an HF checkpoint) rather than a model.ModelConfig preset."""
        return self.model not in MODEL_PRESETS and os.path.isdir(self.model)


# ---- every field checked: one row per field, (test(value, cfg), what is expected) ----
# The expectation is the error's text: `--grad_clip=-1: expected > 0`. `{field}` in it is filled from the config, so a
# row may compare with another field. Every Config field needs a row (tests/test_bad_inputs.py checks); the type
# (int, float -- finite --, str, bool) is checked before the rows, from the dataclass annotation.

CHECKS = {
    "name":               ((lambda v, c: v != "" and "/" not in v and v not in (".", "..")), "a run name (no '/')"),
    "seed":               at_least(0),
    "rl_seed":            ((lambda v, c: v >= -1), ">= 0, or -1 (= seed)"),
    "threads":            at_least(1),
    "warmup_threads":     at_least(1),
    "device":             one_of("auto", "cpu", "cuda"),
    "out":                ((lambda v, c: not os.path.isfile(v) and _writable_dir(v or os.path.join("runs", c.name))),
                           "a directory ('' = runs/<name>) this process can write or create, not a file"),
    "cache_dir":          ((lambda v, c: v != "" and _writable_dir(v)),
                           "a directory this process can write or create (non-empty, not a file)"),
    "task":               ((lambda v, c: _parses(factory, v)),
                           f"one of {', '.join(TASKS)}, or an importable module:factory (factory(cfg) -> task)"),
    "min_steps":          ((lambda v, c: 1 <= v <= c.max_steps), "in [1, max_steps={max_steps}]"),
    "max_steps":          ((lambda v, c: c.min_steps <= v <= 18), "in [min_steps={min_steps}, 18]"),
    "p_explicit":         ((lambda v, c: 0 <= v <= 1), "in [0, 1]"),
    "format_weight":      at_least(0),
    "model":              ((lambda v, c: v in MODEL_PRESETS or os.path.isdir(v)),
                           f"a preset ({', '.join(sorted(MODEL_PRESETS))}) or an HF checkpoint directory"),
    "data":               ((lambda v, c: v == "" or os.path.isfile(v)),
                           "'' or a jsonl / parquet file with a prompt and an answer per row"),
    "prompt_key":         ((lambda v, c: v != ""), "a field name (non-empty)"),
    "answer_key":         ((lambda v, c: v != ""), "a field name (non-empty)"),
    "chat_template":      ((lambda v, c: v == "" or v == "none" or os.path.isfile(v) or "{" in v),
                           "'' (the checkpoint's), 'none', a template file or a Jinja string"),
    "reward":             REWARD_ROW,  # tasks/hf_reward.py: its errors name the module, the function, the signature
    "eval_fraction":      ((lambda v, c: 0 < v < 1), "in (0, 1)"),
    "max_prompt_tokens":  at_least(1),
    "max_new_tokens":     ((lambda v, c: v >= 0), ">= 0 (0 = the task's own)"),
    "sft_steps":          at_least(1),
    "sft_batch":          at_least(1),
    "sft_lr":             above(0),
    "cold_start":         FLAG,
    "draft":              ((lambda v, c: v == "" or (os.path.isfile(os.path.join(v, "config.json")) and not c.cold_start
                                                     and not c.draft_vocab and not c.tap_layers)),
                           "'' or a draft directory (config.json) in a format harness/draft_formats.py reads, not with "
                           "--cold_start, --draft_vocab or --tap_layers (the draft brings its own)"),
    "no_spec":            ((lambda v, c: not v or not (c.draft or c.cold_start or c.num_draft_tokens == "auto" or c.tree
                                                   or True in (c.frozen_arm, c.cold_arm, c.offline_arm))),
                           "false with --draft, --cold_start, --num_draft_tokens=auto, --tree or a control arm set "
                           "to true (plain GRPO has no draft)"),
    "rollout_engine":     ((lambda v, c: v == "home" or (v == "vllm" and not c.tree
                                                         and isinstance(c.num_draft_tokens, int))),
                           "home, or vllm with a chain and a fixed --num_draft_tokens"),
    "frozen_arm":         AUTO_FLAG,
    "cold_arm":           AUTO_FLAG,
    "offline_arm":        AUTO_FLAG,
    "log_kl":             AUTO_FLAG,
    "draft_every":        at_least(1),
    "draft_warmup_steps": at_least(0),
    "draft_vocab":        ((lambda v, c: v >= 0), ">= 0 (0 = the full vocabulary)"),
    "draft_warmup_batch": ((lambda v, c: 1 <= v <= c.draft_warmup_pool),
                           "in [1, draft_warmup_pool={draft_warmup_pool}]"),
    "draft_warmup_lr":    above(0),
    "draft_warmup_pool":  at_least(1),
    "draft_lr":           above(0),
    "draft_lam":          at_least(0),
    "draft_grad_clip":    above(0),  # clip_grad_norm_ with a bound <= 0 flips or zeroes the gradient
    "ttt_passes":         at_least(1),
    "ttt_decay":          ((lambda v, c: 0 <= v <= 1), "in [0, 1] (pass d weighs ttt_decay^(d-1); 0: pass 1 only)"),
    "anchors":            at_least(1),
    "block_gamma":        at_least(0),
    "draft_layers":       at_least(1),
    "markov_rank":        at_least(1),
    "confidence_threshold": ((lambda v, c: 0 <= v <= 1), "in [0, 1] (0: off; the draft's confidence head)"),
    "steps":              at_least(1),
    "prompts_per_step":   at_least(1),
    "group_size":         at_least(2),  # GRPO's advantage is relative to the group: one sample has none
    "temperature":        ((lambda v, c: v > 0), "> 0 (GRPO needs G different samples of a prompt: greedy decoding, "
                           "tau = 0, would give G identical ones and log-probs at 1 / 0)"),
    "max_draft_tokens":   ((lambda v, c: 1 <= v <= 16), "in [1, 16]"),
    "tree":               ((lambda v, c: isinstance(v, tuple) and all(type(b) is int and b >= 1 for b in v)
                                         and len(v) in (0, c.num_draft_tokens)
                                         and sum(math.prod(v[:j]) for j in range(1, len(v) + 1)) <= Tree.MAX_NODES),
                           "() or branching factors >= 1, as many as num_draft_tokens={num_draft_tokens} (the tree's "
                           f"depth) and at most {Tree.MAX_NODES} nodes in all, e.g. --tree=2,2,1"),
    "rollout_batch":      at_least(1),
    "lr":                 at_least(0),  # 0: the no-drift control (the policy does not move)
    "grad_clip":          above(0),  # a negative bound flips the gradient: the update would ascend
    "updates":            ((lambda v, c: 1 <= v <= c.prompts_per_step * c.group_size),
                           "in [1, prompts_per_step * group_size = {prompts_per_step} * {group_size}]"),
    "micro_batches":      ((lambda v, c: v == "auto" or type(v) is int and v >= 1 and all(
                               n % v == 0 for n in _update_sizes(c))),
                           "a divisor of each update's sequences (prompts_per_step * group_size = {prompts_per_step} "
                           "* {group_size} sequences in updates={updates} minibatches, each cut into micro_batches "
                           "equal micro-batches), or auto"),
    "eps_low":            ((lambda v, c: 0 <= v < 1), "in [0, 1)"),
    "eps_high":           at_least(0),
    "beta":               at_least(0),
    "std_norm":           FLAG,
    "loss_norm":          ((lambda v, c: v in LOSS_NORMS),  # read at check time: register_loss_norm adds names
                           f"one of {', '.join(LOSS_NORMS)} (rl_loop.LOSS_NORMS)"),
    "eval_every":         at_least(1),
    "eval_prompts":       at_least(1),
    "eval_samples":       at_least(1),
    "bootstrap":          at_least(1),
    "pp":                 at_least(1),
    "cp":                 at_least(1),
    "dp":                 ((lambda v, c: v >= 0), ">= 0 (0 = world / (pp * cp))"),
    "schedule":           one_of(*SCHEDULES),
    "activation_checkpointing": FLAG,
    "zero1":              ((lambda v, c: v is True or v is False or v == "auto"), "true, false or auto"),
    "fit_check":          FLAG,
    "device_gib":         at_least(0),
    "micro_batch_tokens": at_least(0),
    "attn_backend":       one_of("auto", "torch", "triton", "flash"),
    "dtype":              one_of("auto", "bf16", "fp32"),
    "chunk_mib":          ((lambda v, c: v >= 0), ">= 0 (0 = the unfused (T, V) logits, the reference path)"),
    "ckpt_every":         ((lambda v, c: v >= 0), ">= 0 (0 = never)"),
    "log":                ((lambda v, c: _parses(parse_backends, v) and _installed(parse_backends(v))),
                           f"a comma list of {', '.join(BACKENDS)}, each installed (pip install -e \".[wandb]\", "
                           "\".[tensorboard]\")"),
    "resume":             FLAG,
    "overwrite":          ((lambda v, c: not (v and c.resume)), "false with --resume (a resume keeps the run's files)"),
    "resume_changed_inputs": FLAG,
    "dist_timeout":       at_least(1),
}  # + the rows that name the draft families (tap_layers, drafter, block_size, mask_token_id, *_draft_tokens):
CHECKS.update(family_rows(DRAFTERS))  # config_checks.family_rows, refreshed by Config.__post_init__



USAGE = "usage: python train.py [--preset NAME] [--key=value | --key value | --flag] ..."


def help_text(usage: str = USAGE, brief: bool = False) -> str:
    """usage, the presets, then every Config field by topic (flag_groups.GROUPS, the paper's knobs first): type,
    default, expectation (CHECKS) and meaning (its comment). brief (--help): the main groups' flags one line each,
    the other groups by name, and how to see them all (--help_all)."""
    expect = {k: rule[1].format(**vars(Config())) for k, rule in CHECKS.items()}
    pad = " " * (max(map(len, PRESETS)) + 4)
    presets = [textwrap.fill(" ".join(f"{k}={_show(v)}" for k, v in kv.items()) or "the defaults below", 118,
                             initial_indent=f"  {n:<{len(pad) - 4}}  ", subsequent_indent=pad)
               for n, kv in PRESETS.items()]
    more = (["", f"{HELP_ALL}: every flag with its default, what it expects and its whole meaning."] if brief else [])
    return "\n".join([usage, "", "--preset NAME: named overrides, applied first (flags given with it override them):",
                      *presets, "", "flags: --key=value or --key value; a bool also as --key alone (= true). A value "
                      "outside what is expected", "stops the run before it starts. Every error is one line naming the "
                      "flag or file (exit 1;", "COSPEC_TRACEBACK=1: the traceback too); Ctrl-C names the last "
                      "checkpoint, to continue with --resume.", *more, "",
                      grouped_help(Config, GROUPS, expect, brief=brief), *more])


def parse_args(argv: list, usage: str = USAGE) -> Config:
    """--preset NAME, --flag (a bool set to true), and --key=value or --key value for any Config field (type-checked).
    -h / --help: print help_text(usage, brief=True) (rank 0 only) and exit 0; --help_all: help_text(usage)."""
    if wants_help(argv) or HELP_ALL in argv:
        print_help(help_text(usage, brief=HELP_ALL not in argv))
        raise SystemExit(0)
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
        if not eq and typ not in ("bool", "bool | str"):  # --key value
            if i >= len(argv) or argv[i].startswith("--"):
                raise ValueError(f"--{key}: expected --{key}=<{typ}> or --{key} <{typ}>")
            val, eq = argv[i], "="
            i += 1
        elif not eq and i < len(argv) and not argv[i].startswith("--"):  # a bool's value: --zero1 auto, --resume true
            val, eq = argv[i], "="  # (no flag takes a bare word otherwise: a value it is, checked like --key=value)
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
        if typ == "bool | str" and val.lower() not in ("true", "false", "1", "0"):  # --zero1=auto (CHECKS says which)
            return val
        if typ in ("bool", "bool | str"):
            if val.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return val.lower() in ("true", "1")
        if typ == "tuple":  # --tree=2,2,1; --tree= (empty) is ()
            return tuple(int(v) for v in val.split(",") if v.strip())
        if typ == "bool | str":  # --cold_arm, --cold_arm=false or =auto
            return val.lower() in ("true", "1") if val.lower() in ("true", "false", "1", "0") else val
        if typ == "int | str":  # --num_draft_tokens=4 or =auto: a word stays a word, CHECKS says which
            return int(val) if val.strip().lstrip("+-").isdigit() else val
        return {"int": int, "float": float, "str": str}[typ](val)
    except ValueError:
        raise ValueError(f"--{key}={val!r}: expected a value of type {typ}") from None
