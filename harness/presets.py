"""train.py's named presets (--preset NAME): each a set of Config overrides, with the size and time it is for.

May import nothing: harness/config.py reads PRESETS, and a preset names Config fields by their flags.
"""

PRESETS = {
    # the experiment of docs/experiment.md (timings there). The mini model learns the additions in
    # 1000 SFT steps when 70% of the demo steps are explicit (the operands sit side by side), which still leaves RL
    # a format term to raise; 32 prompts per step keep the GRPO update above the noise (fewer leave it inside).
    "default": {},
    # the 1.1M small model, a longer drift, and speculative rollouts that pay on CPU once acceptance nears 3
    # (docs/experiment.md, docs/train_small.json); 60 steps, ~5 min of RL + ~15 min of warm-ups on 2 cores
    "small": dict(name="small", model="small", p_explicit=0.3, sft_steps=1200, sft_lr=3e-3, steps=60,
                  prompts_per_step=16, rollout_batch=16, lr=2e-4, eval_prompts=32, draft_warmup_steps=200,
                  draft_warmup_batch=64, draft_warmup_lr=1e-3, num_draft_tokens=3, draft_every=1),
    # CI-sized: every code path and a visible learning signal, ~2.5 min on 2 cores from an empty cache
    # (tests/test_train_torchrun.py)
    "smoke": dict(name="smoke", model="tiny", sft_steps=800, draft_warmup_steps=60, draft_warmup_batch=64,
                  draft_warmup_lr=1e-3, draft_warmup_pool=256, steps=20, rollout_batch=64, eval_prompts=16, max_steps=5,
                  lr=3e-4, num_draft_tokens=3, draft_every=1),  # a short run: the drafts train on every update
    # one GPU at world size 1: the small model's experiment with 256 rollouts a step in one generate call, no cold or
    # offline arm, no KL log, evaluated at the first and last step; bench/gpu_check.sh's end-to-end stage runs it,
    # then the same with --no_spec, within 95 + 40 s (the first run's warm-ups included, the second's cached)
    "gpu": dict(name="gpu", model="small", p_explicit=0.3, sft_steps=800, sft_lr=3e-3, steps=8, prompts_per_step=32,
                rollout_batch=256, lr=2e-4, eval_every=8, eval_prompts=32, draft_warmup_steps=150,
                draft_warmup_batch=64, draft_warmup_lr=1e-3, num_draft_tokens=3, draft_every=1, cold_arm=False,
                offline_arm=False, log_kl=False),
    # for tests: seconds
    "test": dict(name="test", model="tiny", sft_steps=3, sft_batch=8, draft_warmup_steps=2, draft_warmup_batch=4,
                 draft_warmup_pool=8, steps=2, prompts_per_step=2, group_size=4, eval_every=1, eval_prompts=2,
                 eval_samples=2, min_steps=1, max_steps=2, micro_batches=2, draft_every=1),
}
