"""The evaluation of a run's draft arms on held-out prompts: how many tokens each draft lets one policy forward keep,
and what that buys in rollout speed.

    ev = evaluate(s)      # {"reward", "correct", "explicit", "accept_<arm>", "tok_s_<arm>", "speedup_<arm>", ...}

Arms, all on the same prompts, seed and policy snapshot: "ar" (no draft: plain autoregressive sampling through the same
engine), "cotrained" (the draft that drives the rollouts), "frozen" (a copy of the warm-up draft, never updated) and
"cold" (co-trained from an untrained start, evaluated only).

    acceptance length = kept / row_steps       tokens kept per verification forward (up to EOS / max_new_tokens),
                                               bonus included, prefill excluded (speculative.kept_tokens)
    speedup           = median over chunks of tok/s(arm) / tok/s(ar)

A shared CPU's load swings +-40% between calls, so the arms run interleaved chunk by chunk in a rotating order after
one untimed warm-up call each, and a speedup is the median of the PAIRED per-chunk ratios: a change in load hits every
arm of a chunk alike. The held-out reward comes from the "ar" arm's samples (exact policy samples).
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from rollout import explicit_share, generate

if TYPE_CHECKING:
    from experiment import Setup


def arms(s: Setup) -> dict:
    """arm name -> draft (None: autoregressive)."""
    out = {"ar": None, "cotrained": s.drafts["cotrained"].draft, "frozen": s.frozen}
    if "cold" in s.drafts:
        out["cold"] = s.drafts["cold"].draft
    return out


@torch.no_grad()
def evaluate(s: Setup) -> dict:
    c = s.cfg
    probs = [p for p in s.eval_problems for _ in range(c.eval_samples)]
    prompts = [s.task.encode_prompt(p) for p in probs]
    drafts = arms(s)
    tot = {name: {"row_steps": 0, "kept": 0, "new_tokens": 0, "seconds": 0.0} for name in drafts}
    for draft in drafts.values():  # untimed warm-up: first-call costs (allocator, caches) would skew a 2-chunk timing
        generate(s, draft, prompts[:2], seed=c.seed)
    ar_toks, chunk_tok_s, names = [], {name: [] for name in drafts}, list(drafts)
    for j, i in enumerate(range(0, len(prompts), c.rollout_batch)):
        for name in names[j % len(names):] + names[: j % len(names)]:  # rotating order
            toks, _, st = generate(s, drafts[name], prompts[i: i + c.rollout_batch], seed=c.seed + 99 + i)
            for k in tot[name]:
                tot[name][k] += st[k]
            chunk_tok_s[name].append(st["tok_s"])
            if name == "ar":
                ar_toks += toks
    R, parts = s.task.score(probs, ar_toks)
    out = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()), "explicit": explicit_share(parts),
           "resp_len": tot["ar"]["new_tokens"] / len(prompts)}
    for name, t in tot.items():
        out[f"tok_s_{name}"] = t["new_tokens"] / max(t["seconds"], 1e-9)
        if name != "ar":
            out[f"accept_{name}"] = t["kept"] / max(t["row_steps"], 1)
            out[f"speedup_{name}"] = statistics.median(a / b for a, b in zip(chunk_tok_s[name], chunk_tok_s["ar"]))
    out["speedup"] = out["speedup_cotrained"]
    return out
