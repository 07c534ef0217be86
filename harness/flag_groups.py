"""train.py's flags by topic, the paper's knobs first: what `--help` shows in brief and `--help_all` in full.

    GROUPS = ((title, main, (field, ...)), ...)    every Config field in exactly one group (tests/test_help.py checks)

`--help` lists each flag of a main group (main = True) with its default and the start of its meaning, and only the
names of the rest; `--help_all` gives every flag its default, its range (config.CHECKS) and its whole comment. A new
Config field joins a group here, or the test names it.

    python train.py --help
    python train.py --help_all
"""
from dataclasses import fields

from rl_loop import GRPOKnobs

GROUPS = (
    ("the draft and its co-training (the draft family; TTT, the training-time unroll; the draft loss's weight "
     "and budget)", True,
     ("drafter", "ttt_passes", "ttt_decay", "tap_layers", "draft_lam", "draft_lr", "draft_every", "draft_grad_clip",
      "draft_vocab", "cold_start", "draft")),
    ("block drafters (a --drafter whose kind is block: a block drafted per forward)", True,
     ("block_size", "anchors", "block_gamma", "draft_layers", "mask_token_id", "markov_rank", "confidence_threshold")),
    ("speculative rollouts (k draft tokens per verification forward; lossless at every k)", True,
     ("num_draft_tokens", "max_draft_tokens", "tree", "no_spec", "rollout_batch", "rollout_engine")),
    ("parallelism under torchrun: the CP ring inside each of the PP stages (TapChannel carries the taps between "
     "them), DP replicas; pp * cp * dp = world size", True,
     ("pp", "cp", "dp", "schedule")),
    ("RL (GRPO)", False,
     ("steps", "prompts_per_step", "group_size", "temperature", "lr", "grad_clip", "updates", "micro_batches",
      "micro_batch_tokens") + tuple(f.name for f in fields(GRPOKnobs))),  # GRPO's own: rl_loop.GRPOKnobs
    ("model and data: a model preset with the built-in task, or HF mode: --model=DIR (an HF checkpoint: Llama / "
     "Qwen2 / Qwen3 + tokenizer.json) with --data=prompts.jsonl (the checkpoint as the policy, no SFT; a math-answer "
     "reward or --reward's)", False,
     ("model", "data", "prompt_key", "answer_key", "chat_template", "reward", "eval_fraction", "max_prompt_tokens",
      "max_new_tokens", "task", "min_steps", "max_steps", "p_explicit", "format_weight")),
    ("warm-ups: the policy's SFT and the draft's offline fit, cached in --cache_dir", False,
     ("sft_steps", "sft_batch", "sft_lr", "draft_warmup_steps", "draft_warmup_batch", "draft_warmup_lr",
      "draft_warmup_pool")),
    ("experiment controls and eval: the frozen, offline-extended and cold-start drafts beside the co-trained one",
     False,
     ("frozen_arm", "offline_arm", "cold_arm", "log_kl", "eval_every", "eval_prompts", "eval_samples",
      "eval_draft_tokens", "bootstrap")),
    ("memory, kernels and precision (docs/memory.md): bf16 runs every forward and KV cache in bf16 and keeps fp32 "
     "masters, grads and AdamW state", False,
     ("attn_backend", "chunk_mib", "dtype", "activation_checkpointing", "zero1", "fit_check", "device_gib")),
    ("run, checkpoints and logging", False,
     ("name", "out", "seed", "rl_seed", "device", "threads", "warmup_threads", "cache_dir", "ckpt_every", "resume",
      "overwrite", "resume_changed_inputs", "log", "dist_timeout")),
)
