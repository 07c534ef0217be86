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
    speedup           = median over chunks of tok/s(arm) / tok/s(ar); speedup_range: the co-trained arm's lowest and
                        highest chunk ratio, its spread

A shared CPU's load swings +-40% between calls, so the arms run interleaved chunk by chunk in a rotating order after
one untimed warm-up call each, and a speedup is the median of the PAIRED per-chunk ratios: a change in load hits every
arm of a chunk alike. The held-out reward comes from the "ar" arm's samples (exact policy samples). Every arm sees the
same rows with the same per-row streams (row_streams.py). Spread like the rollouts: the chunks are blocks of
cfg.rollout_batch rows, block j on rank j mod world (each pairs its arms on its own blocks), pooled on rank 0.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from decoding.row_streams import row_keys
from harness.mesh import gather_all, row_blocks
from harness.rollout import explicit_share, generate

if TYPE_CHECKING:
    from harness.experiment import Setup
    from harness.mesh import Mesh

EVAL_STREAM = 0x5EED_E7A1  # the eval rows' key prefix: streams apart from the rollouts' and the offline arm's


def arms(s: Setup) -> dict:
    """arm name -> draft (None: autoregressive), for the arms the run holds (--no_spec: "ar" alone)."""
    out = {"ar": None}
    if "cotrained" in s.drafts:
        out["cotrained"] = s.drafts["cotrained"].draft
    if s.frozen is not None:
        out["frozen"] = s.frozen
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
def evaluate(s: Setup, mesh: Mesh = None) -> dict:
    """Every rank evaluates its blocks of the eval rows (mesh.row_blocks; mesh None: one process, all of them); rank 0
    pools them and returns the dict (the other ranks: None)."""
    c = s.cfg
    probs = [p for p in s.eval_problems for _ in range(c.eval_samples)]
    prompts = [s.task.encode_prompt(p) for p in probs]
    r = torch.arange(len(prompts))
    keys = row_keys(EVAL_STREAM, c.seed, r // c.eval_samples, r % c.eval_samples)  # the same rows in every arm
    drafts = arms(s)
    for draft in drafts.values():  # untimed warm-up: first-call costs (allocator, caches) would skew a 2-chunk timing
        generate(s, draft, prompts[:2], keys[:2], k=c.eval_k)
    names, mine = list(drafts), []
    blocks = mesh.blocks(len(prompts), c.rollout_batch) if mesh is not None else row_blocks(len(prompts),
                                                                                             c.rollout_batch, 0, 1)
    for j, rows in blocks:
        out = {}
        for name in names[j % len(names):] + names[: j % len(names)]:  # rotating order
            toks, _, st = generate(s, drafts[name], prompts[rows.start: rows.stop], keys[rows.start: rows.stop],
                                   k=c.eval_k)
            out[name] = (toks if name == "ar" else None, st)
        mine.append((j, out))
    parts = gather_all(mine) if mesh is not None else [mine]  # sync point
    done = sorted((b for part in parts for b in part), key=lambda b: b[0])
    return pool(s, probs, [b for _, b in done], drafts) if mesh is None or mesh.main else None


def pool(s: Setup, probs: list, blocks: list, drafts: dict) -> dict:
    """The eval's numbers from every block's per-arm (tokens of "ar", stats), in block order."""
    c = s.cfg
    tot = {name: {key: sum(b[name][1][key] for b in blocks) for key in ("row_steps", "kept", "new_tokens", "seconds")}
           for name in drafts}
    rows = {name: {key: [x for b in blocks for x in b[name][1][key]] for key in ("row_kept", "row_forwards")}
            for name in drafts}
    chunk_tok_s = {name: [b[name][1]["tok_s"] for b in blocks] for name in drafts}
    ratios = {name: [a / b for a, b in zip(chunk_tok_s[name], chunk_tok_s["ar"])] for name in drafts}  # paired
    R, parts = s.task.score(probs, [t for b in blocks for t in b["ar"][0]])
    out = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()), "explicit": explicit_share(parts),
           "resp_len": tot["ar"]["new_tokens"] / len(probs), "eval_k": c.eval_k}
    for name, t in tot.items():
        out[f"tok_s_{name}"] = t["new_tokens"] / max(t["seconds"], 1e-9)
        if name != "ar":
            out[f"accept_{name}"] = t["kept"] / t["row_steps"] if t["row_steps"] else None  # no verification: none
            out[f"speedup_{name}"] = statistics.median(ratios[name])
    for other in ("frozen", "offline", "cold"):
        if other in rows and out[f"accept_{other}"] is not None and out.get("accept_cotrained") is not None:
            a, b = rows["cotrained"], rows[other]
            out[f"accept_gain_vs_{other}_ci"] = paired_bootstrap(a["row_kept"], a["row_forwards"], b["row_kept"],
                                                                 b["row_forwards"], c.eval_samples, c.bootstrap, c.seed)
    if "cotrained" in drafts:
        out["speedup"] = out["speedup_cotrained"]
        out["speedup_range"] = [min(ratios["cotrained"]), max(ratios["cotrained"])]  # its spread: lowest, highest
    return out
