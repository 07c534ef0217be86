"""The pieces of one experiment run, shared by the single-process loop and the torchrun one (train.py).

    build(cfg) -> Setup     the task, warm policy (SFT, cached; HF mode: the checkpoint) + frozen reference + drafts
                            (co-trained, frozen copy, cold start)
    rollout(s, problems)    G speculative samples per prompt, rewards, group advantages -> RolloutBatch
    update(s, batch)        `updates` GRPO + co-training steps (rl_loop.cotrain_step: one policy forward each)
    evaluate(s)             acceptance length of every draft arm and tokens/s with / without speculation, held-out

Letters: B rollout rows, G group size, T packed tokens.
"""
from __future__ import annotations

import copy
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import speculative
import task
import warmup
from draft import Eagle3Draft
from hf_io import from_pretrained
from model import ModelConfig, Transformer
from attention_padded import padded_branch_attention, padded_causal_attention
from rl_loop import (DraftTrainer, GRPOConfig, RolloutBatch, check_finite_weights, cotrain_step, group_advantages,
                     reference_logp, rollout_kl)

if TYPE_CHECKING:
    from config import Config


# --------------------------------------------------------------------------------------------------- the pieces
@dataclass
class Setup:
    cfg: Config
    task: object  # task.CountUpTask or hf_task.HFTask: tok, sample, eval_set, encode_prompt, score, max_new_tokens
    policy: torch.nn.Module
    ref: torch.nn.Module  # frozen pi_0 (the SFT policy): KL drift and the optional k3 penalty
    opt: torch.optim.Optimizer
    drafts: dict  # arm name -> DraftTrainer ("cotrained" drives the rollouts; "cold" is evaluated only)
    frozen: Eagle3Draft  # the warm-up draft, never updated
    eval_problems: list
    rng: random.Random
    gen: torch.Generator
    grpo: GRPOConfig
    warm_info: dict = field(default_factory=dict)


def build_task(cfg: Config):
    """The built-in count-up task, or in HF mode the prompts file with the checkpoint's tokenizer (hf_task.py)."""
    if cfg.hf_mode:
        from hf_task import HFTask
        return HFTask(cfg.model, cfg.data, eval_fraction=cfg.eval_fraction, seed=cfg.seed,
                      max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens or 256)
    tsk = task.CountUpTask(cfg.min_steps, cfg.max_steps, cfg.format_weight)
    tsk.max_new_tokens = cfg.max_new_tokens or tsk.max_new_tokens
    return tsk


def pick_device(cfg: Config) -> torch.device:
    """Where this process's models live. cfg.device "auto": its own GPU (LOCAL_RANK under torchrun) when CUDA is present
    and every process on the node gets one (NCCL cannot share a GPU between ranks), else the CPU."""
    n_local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.device == "cpu" or not torch.cuda.is_available():  # Config rejects device="cuda" without CUDA
        return torch.device("cpu")
    if n_local > torch.cuda.device_count():
        if cfg.device == "cuda":
            raise ValueError(f"device='cuda': {n_local} processes on this node but {torch.cuda.device_count()} GPU(s); "
                             "each rank needs its own GPU (or run with --device=cpu)")
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def build_policy(cfg: Config, tsk, log=print, device=None) -> tuple[Transformer, str, bool]:
    """-> (policy on `device`, cache key, loaded): the SFT'd policy of the built-in task (cached), or the HF checkpoint
    as is."""
    if cfg.hf_mode:
        policy = from_pretrained(cfg.model).to(device)
        key = warmup.cache_key("hf", warmup.fingerprint(cfg.model), warmup.fingerprint(cfg.data))
        n = sum(p.numel() for p in policy.parameters())
        log(f"policy: HF checkpoint {cfg.model} ({policy.cfg.architecture}, {n:,} parameters); "
            f"{sum(map(len, tsk.splits.values()))} prompts from {cfg.data} ({len(tsk.splits['eval'])} held out, "
            f"{tsk.dropped} dropped as longer than {cfg.max_prompt_tokens} tokens)")
        return policy, key, True
    mcfg, t0 = ModelConfig.preset(cfg.model, vocab_size=tsk.tok.vocab_size), time.perf_counter()
    policy, key, loaded = warmup.warm_policy(mcfg, tsk.tok, tsk.source, steps=cfg.sft_steps, batch=cfg.sft_batch,
                                             lr=cfg.sft_lr, p_explicit=cfg.p_explicit, seed=cfg.seed,
                                             cache_dir=cfg.cache_dir, log_every=max(cfg.sft_steps // 6, 1),
                                             device=device)
    log(f"policy SFT warm-up: {'loaded from cache' if loaded else 'trained'} ({key}, {time.perf_counter() - t0:.0f}s)")
    return policy, key, loaded


def build(cfg: Config, log=print) -> Setup:
    """Task, warm policy (SFT'd or the HF checkpoint), reference, draft arms and optimizer, on pick_device(cfg)."""
    torch.manual_seed(cfg.seed)
    tsk = build_task(cfg)
    dev = pick_device(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.warmup_threads)  # the warm-ups run alone (other ranks wait): they may use every core
    try:
        t0 = time.perf_counter()
        policy, pkey, loaded = build_policy(cfg, tsk, log, dev)
        t1 = time.perf_counter()
        warm, dloaded = warmup.warm_draft(policy, tsk, steps=cfg.draft_warmup_steps, batch=cfg.draft_warmup_batch,
                                          lr=cfg.draft_warmup_lr, pool=cfg.draft_warmup_pool,
                                          max_new_tokens=tsk.max_new_tokens, num_passes=cfg.ttt_passes, seed=cfg.seed,
                                          policy_key=pkey, cache_dir=cfg.cache_dir, attn_fn=padded_causal_attention,
                                          draft_attn_fn=padded_branch_attention,
                                          log_every=max(cfg.draft_warmup_steps // 4, 1))
        t2 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    done = "none (an untrained draft)" if cfg.draft_warmup_steps == 0 else "loaded from cache" if dloaded else "trained"
    log(f"draft warm-up: {done} ({t2 - t1:.0f}s)")
    ref = copy.deepcopy(policy).requires_grad_(False)
    frozen = copy.deepcopy(warm).requires_grad_(False)
    frozen.attach(policy)  # like the co-trained draft it reads the live policy's embedding; its own weights stay put

    def trainer(d):
        return DraftTrainer(d, torch.optim.AdamW(d.parameters(), lr=cfg.draft_lr, weight_decay=0.0), lam=cfg.draft_lam,
                            grad_clip=cfg.draft_grad_clip, num_passes=cfg.ttt_passes, attn_fn=padded_branch_attention)

    torch.manual_seed(cfg.seed + 7)
    drafts = {"cotrained": trainer(Eagle3Draft.from_target(policy) if cfg.cold_start else warm)}
    if cfg.cold_arm and not cfg.cold_start:
        drafts["cold"] = trainer(Eagle3Draft.from_target(policy))
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    grpo = GRPOConfig(eps_low=cfg.eps_low, eps_high=cfg.eps_high, beta=cfg.beta, std_norm=cfg.std_norm,
                      loss_norm=cfg.loss_norm, max_len=tsk.max_new_tokens)
    return Setup(cfg, tsk, policy, ref, opt, drafts, frozen, tsk.eval_set(cfg.eval_prompts, cfg.seed + 1234),
                 random.Random(cfg.seed), torch.Generator(device=dev).manual_seed(cfg.seed), grpo,
                 {"sft_s": t1 - t0, "draft_warmup_s": t2 - t1, "policy_cached": loaded, "draft_cached": dloaded})


def generate(s: Setup, draft, prompts: list, seed=None):
    """speculative.generate over chunks of cfg.rollout_batch rows -> (tokens, logprobs, stats). draft=None: plain
    autoregressive sampling through the same engine. seed: a fresh generator (every eval arm sees the same seed)."""
    c = s.cfg
    gen = s.gen if seed is None else torch.Generator(device=s.gen.device).manual_seed(seed)
    toks, lps, st = [], [], {"row_steps": 0, "accepted": 0, "new_tokens": 0, "seconds": 0.0}
    for i in range(0, len(prompts), c.rollout_batch):
        r = speculative.generate(s.policy, draft, prompts[i: i + c.rollout_batch],
                                 max_new_tokens=s.task.max_new_tokens,
                                 num_draft_tokens=c.num_draft_tokens if draft is not None else 0,
                                 temperature=c.temperature, eos_id=s.task.tok.eos_id, generator=gen)
        toks += [t.cpu() for t in r.tokens]  # rollouts are scored, packed and exchanged on the host
        lps += [lp.cpu() for lp in r.logprobs]
        for k in st:
            st[k] += getattr(r.stats, k)
    st["accept_len"] = (st["row_steps"] + st["accepted"]) / max(st["row_steps"], 1)  # tokens per policy forward
    st["tok_s"] = st["new_tokens"] / max(st["seconds"], 1e-9)
    return toks, lps, st


def rollout(s: Setup, problems: list) -> tuple[RolloutBatch, dict]:
    """G speculative samples per problem -> scored, advantage-weighted RolloutBatch and stats."""
    c = s.cfg
    prompts = [s.task.encode_prompt(p) for p in problems for _ in range(c.group_size)]
    toks, lps, st = generate(s, s.drafts["cotrained"].draft, prompts)
    R, parts = s.task.score([p for p in problems for _ in range(c.group_size)], toks)
    adv, valid = group_advantages(R, c.group_size, std_norm=c.std_norm)
    batch = RolloutBatch.from_rollouts(prompts, toks, lps, adv, valid)
    info = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()),
            "explicit": _explicit(parts), "resp_len": st["new_tokens"] / len(prompts),
            "zero_var_groups": int((~valid).sum()) // c.group_size,
            "accept_len": st["accept_len"], "rollout_tok_s": st["tok_s"]}
    return batch, info


def _explicit(parts: dict) -> float:
    """The built-in task's format term (share of steps written explicitly); HF mode has none: 0."""
    return float(parts["explicit"].mean()) if "explicit" in parts else 0.0


def update(s: Setup, batch: RolloutBatch, timer: dict) -> dict:
    """Reference log-probs (k3 penalty, KL drift), then cfg.updates optimisation steps on random minibatches of the
    rollout batch (old log-probs from the rollout)."""
    t0 = time.perf_counter()
    batch.ref_logp = reference_logp(s.ref, batch, attn_fn=padded_causal_attention)
    kl = rollout_kl(batch)
    timer["policy_train"] = timer.get("policy_train", 0.0) + time.perf_counter() - t0
    perm = torch.randperm(batch.num_seqs, generator=s.gen, device=s.gen.device).cpu()  # the rollout stream
    stats = []
    for idx in perm.chunk(s.cfg.updates):
        stats.append(cotrain_step(s.policy, s.opt, batch.select(idx.sort().values), s.grpo, list(s.drafts.values()),
                                  micro_batches=s.cfg.micro_batches, policy_grad_clip=s.cfg.grad_clip,
                                  attn_fn=padded_causal_attention, timer=timer))
    return _update_stats(s, stats, kl)


def _update_stats(s: Setup, stats: list, kl: float) -> dict:
    last = stats[-1]
    out = {k: sum(st[k] for st in stats) / len(stats) for k in ("loss_policy", "clip_frac", "ratio", "grad_norm")}
    for name, m in zip(s.drafts, last["draft_metrics"]):
        out[f"tau_hat_{name}"] = m["tau_hat"]
    out["loss_draft"] = last["loss_draft"][0]
    out["kl"] = kl
    return out


def check_finite(step: int, up: dict, s: Setup):
    """Stop the run at the first NaN/inf loss or weight, naming it (every rank holds the same reduced values and the
    same refitted full copies: all ranks stop). A finite loss can still be followed by an update that overflows the
    weights (too large a learning rate), which would only surface later as a sampling error: the weights are checked
    too, once per step."""
    hint = "stopping. Try a lower --lr / --draft_lr or a smaller --grad_clip / --draft_grad_clip"
    for key in ("loss_policy", "loss_draft", "grad_norm"):
        if not math.isfinite(up[key]):
            raise FloatingPointError(f"step {step}: {key} = {up[key]} (not finite); {hint}")
    for name, m in {"policy": s.policy, **{f"{name} draft": tr.draft for name, tr in s.drafts.items()}}.items():
        check_finite_weights(m, f"step {step}: after the update, the {name}", hint)


@torch.no_grad()
def evaluate(s: Setup) -> dict:
    """Same held-out prompts and seed for every arm: acceptance length per draft, tokens/s with and without speculation,
    and the policy's held-out reward (from the autoregressive samples, exact policy samples). The arms run interleaved
    chunk by chunk in a rotating order, and a speedup is the median over chunks of the paired tok/s ratio, so a change in
    machine load (large on a shared CPU) hits every arm alike."""
    c = s.cfg
    probs = [p for p in s.eval_problems for _ in range(c.eval_samples)]
    prompts = [s.task.encode_prompt(p) for p in probs]
    arms = {"ar": None, "cotrained": s.drafts["cotrained"].draft, "frozen": s.frozen}
    if "cold" in s.drafts:
        arms["cold"] = s.drafts["cold"].draft
    tot = {name: {"row_steps": 0, "accepted": 0, "new_tokens": 0, "seconds": 0.0} for name in arms}
    for draft in arms.values():  # untimed warm-up: first-call costs (allocator, caches) would skew a 2-chunk timing
        generate(s, draft, prompts[:2], seed=c.seed)
    ar_toks, chunk_tok_s, names = [], {name: [] for name in arms}, list(arms)
    for j, i in enumerate(range(0, len(prompts), c.rollout_batch)):
        for name in names[j % len(names):] + names[: j % len(names)]:
            toks, _, st = generate(s, arms[name], prompts[i: i + c.rollout_batch], seed=c.seed + 99 + i)
            for k in tot[name]:
                tot[name][k] += st[k]
            chunk_tok_s[name].append(st["tok_s"])
            if name == "ar":
                ar_toks += toks
    R, parts = s.task.score(probs, ar_toks)
    out = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()), "explicit": _explicit(parts),
           "resp_len": tot["ar"]["new_tokens"] / len(prompts)}
    for name, t in tot.items():
        out[f"tok_s_{name}"] = t["new_tokens"] / max(t["seconds"], 1e-9)
        if name != "ar":
            out[f"accept_{name}"] = (t["row_steps"] + t["accepted"]) / max(t["row_steps"], 1)
            out[f"speedup_{name}"] = statistics.median(a / b for a, b in zip(chunk_tok_s[name], chunk_tok_s["ar"]))
    out["speedup"] = out["speedup_cotrained"]
    return out
