"""The evaluation of a run's draft arms on held-out prompts: how many tokens each draft lets one policy forward keep,
with paired bootstrap intervals for the gains, and what that buys in rollout speed.

    ev = evaluate(s)      # {"reward", "correct", "explicit", "accept_<arm>", "tok_s_<arm>", "speedup_<arm>",
                          #  "accept_gain_vs_frozen_ci", "accept_gain_vs_offline_ci", ...}

Arms, all on the same prompts, seeds and policy snapshot: "ar" (no draft: plain autoregressive sampling through the
same engine), "cotrained" (the draft that drives the rollouts), "frozen" (a copy of the warm-up draft, never updated),
"offline" (the warm-up draft trained as much on fresh pi_0 samples: offline_arm.py) and "cold" (co-trained from an
untrained start, evaluated only). k = cfg.eval_k draft tokens per step.

    acceptance length = sum kept / sum row_forwards     tokens kept per verification forward (up to EOS /
                                                        max_new_tokens), bonus included, prefill excluded
                                                        (speculative.kept_tokens), pooled over the eval rows; None
                                                        when there was no verification forward (max_new_tokens 1)
    gain interval     = paired bootstrap over eval PROMPTS: resample prompts with replacement (each with all its
                        samples, in both arms), recompute both pooled ratios, take the 2.5 / 97.5 percentiles of
                        their difference (cfg.bootstrap resamples) [Efron & Tibshirani 1993, percentile interval]
    speedup           = median over chunks of tok/s(arm) / tok/s(ar)

A shared CPU's load swings +-40% between calls, so the arms run interleaved chunk by chunk in a rotating order after
one untimed warm-up call each, and a speedup is the median of the PAIRED per-chunk ratios: a change in load hits every
arm of a chunk alike. The held-out reward comes from the "ar" arm's samples (exact policy samples).
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from harness.rollout import explicit_share, generate

if TYPE_CHECKING:
    from harness.experiment import Setup


def arms(s: Setup) -> dict:
    """arm name -> draft (None: autoregressive)."""
    out = {"ar": None, "cotrained": s.drafts["cotrained"].draft, "frozen": s.frozen}
    if s.offline is not None:
        out["offline"] = s.offline.draft
    if "cold" in s.drafts:
        out["cold"] = s.drafts["cold"].draft
    return out


def paired_bootstrap(kept_a, fwd_a, kept_b, fwd_b, group: int, n: int, seed: int = 0) -> list:
    """95% percentile interval of ratio(a) - ratio(b), ratio = sum kept / sum forwards, resampling prompts (units of
    `group` consecutive rows, the same units in both arms) with replacement. Inputs: per-row counts (R,)."""
    per = [torch.as_tensor(x, dtype=torch.float64).view(-1, group).sum(1) for x in (kept_a, fwd_a, kept_b, fwd_b)]
    P = per[0].numel()  # prompts
    idx = torch.randint(P, (n, P), generator=torch.Generator().manual_seed(seed))  # (n, P) resampled prompts
    ka, fa, kb, fb = (x[idx].sum(1) for x in per)
    diff = ka / fa.clamp_min(1) - kb / fb.clamp_min(1)  # (n,)
    return [float(torch.quantile(diff, 0.025)), float(torch.quantile(diff, 0.975))]


@torch.no_grad()
def evaluate(s: Setup) -> dict:
    c = s.cfg
    probs = [p for p in s.eval_problems for _ in range(c.eval_samples)]
    prompts = [s.task.encode_prompt(p) for p in probs]
    drafts = arms(s)
    tot = {name: {"row_steps": 0, "kept": 0, "new_tokens": 0, "seconds": 0.0} for name in drafts}
    rows = {name: {"row_kept": [], "row_forwards": []} for name in drafts}
    for draft in drafts.values():  # untimed warm-up: first-call costs (allocator, caches) would skew a 2-chunk timing
        generate(s, draft, prompts[:2], seed=c.seed, k=c.eval_k)
    ar_toks, chunk_tok_s, names = [], {name: [] for name in drafts}, list(drafts)
    for j, i in enumerate(range(0, len(prompts), c.rollout_batch)):
        for name in names[j % len(names):] + names[: j % len(names)]:  # rotating order
            toks, _, st = generate(s, drafts[name], prompts[i: i + c.rollout_batch], seed=c.seed + 99 + i, k=c.eval_k)
            for key in tot[name]:
                tot[name][key] += st[key]
            for key in rows[name]:
                rows[name][key] += st[key]
            chunk_tok_s[name].append(st["tok_s"])
            if name == "ar":
                ar_toks += toks
    R, parts = s.task.score(probs, ar_toks)
    out = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()), "explicit": explicit_share(parts),
           "resp_len": tot["ar"]["new_tokens"] / len(prompts), "eval_k": c.eval_k}
    for name, t in tot.items():
        out[f"tok_s_{name}"] = t["new_tokens"] / max(t["seconds"], 1e-9)
        if name != "ar":
            out[f"accept_{name}"] = t["kept"] / t["row_steps"] if t["row_steps"] else None  # no verification: none
            out[f"speedup_{name}"] = statistics.median(a / b for a, b in zip(chunk_tok_s[name], chunk_tok_s["ar"]))
    for other in ("frozen", "offline", "cold"):
        if other in rows and out[f"accept_{other}"] is not None and out["accept_cotrained"] is not None:
            a, b = rows["cotrained"], rows[other]
            out[f"accept_gain_vs_{other}_ci"] = paired_bootstrap(a["row_kept"], a["row_forwards"], b["row_kept"],
                                                                 b["row_forwards"], c.eval_samples, c.bootstrap, c.seed)
    out["speedup"] = out["speedup_cotrained"]
    return out
