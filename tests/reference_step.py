"""The co-training step in one process, written to be read: the test oracle of dist_step.DistCotrainer.step.

One optimisation step of the policy (GRPO) and of every draft from ONE policy forward per micro-batch, with no
pipeline, no ring and no process group: rl_loop.py's math applied in a plain loop. DistCotrainer.step, what train.py
runs at every world size, equals it to fp64 round-off (tests/test_dist_step.py, tests/test_config_matrix.py,
tests/test_micro_batches.py). It adds no seconds by itself: the tests that import it state theirs.

Letters: T packed tokens, S sequences, V vocab.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from draft_ttt import merge_metrics
from modeling.mixed_precision import clip_grads_
from rl_loop import (GRPOConfig, RolloutBatch, aggregate, draft_loss, micro_chunks, next_token_logp, seq_ids,
                     token_losses)


def policy_loss(logp, mb: RolloutBatch, cfg: GRPOConfig, *, n_seqs: int, n_tokens: int, n_micro: int = 1):
    """The GRPO loss of micro-batch mb given the current log-probs logp (T,). Returns (loss, stats)."""
    mask = mb.trained_mask()
    l, clipped, kl = token_losses(logp, mb.old_logp, mb.adv[seq_ids(mb.cu_seqlens)], mb.ref_logp, cfg)
    loss = aggregate(l, mask, mb.cu_seqlens, cfg.loss_norm, n_seqs=n_seqs, n_tokens=n_tokens, max_len=cfg.max_len,
                     n_micro=n_micro)
    with torch.no_grad():
        m = mask.float()
        n = m.sum().clamp_min(1)
        stats = {"clip_frac": float((clipped.float() * m).sum() / n), "k3": float((kl * m).sum() / n),
                 "ratio": float((torch.exp(logp - mb.old_logp) * m).sum() / n), "tokens": int(m.sum())}
    return loss, stats


def cotrain_step(policy, policy_opt, batch: RolloutBatch, cfg: GRPOConfig, drafts: list, *, micro_batches: int = 1,
                 policy_grad_clip: float = 1.0, attn_fn=None, on_policy: bool = False) -> dict:
    """One optimisation step of the policy (GRPO) and of every draft from ONE policy forward per micro-batch.
    on_policy: the policy has not moved since it sampled the batch (an RL step's first update), so pi_old is this
    forward's own log-probs, detached (ratio exactly 1; TRL's GRPO does the same), not batch.old_logp.

    drafts: list of DraftTrainer (the rollout draft, and optionally shadow drafts trained on the same taps), each on
    the untempered teacher softmax(z) (step 4); GRPO's pi are at cfg.temperature.
    total = L_policy + sum_k lambda_k L_draft_k, backward per term: the graphs are disjoint, so the gradients equal
    those of backward(total).
    """
    S = batch.num_seqs
    mask = batch.trained_mask()
    n_seqs, n_tokens = int(batch.valid.sum()), int(mask.sum())
    taps_wanted = sorted({l for tr in drafts for l in tr.draft.tap_layers})
    policy_opt.zero_grad(set_to_none=True)
    for tr in drafts:
        tr.opt.zero_grad(set_to_none=True)
    stats = {"loss_policy": 0.0, "loss_draft": [0.0] * len(drafts), "draft_metrics": [[] for _ in drafts]}
    pstats = []
    dev = next(policy.parameters()).device
    for chunk in micro_chunks(S, micro_batches):
        mb = batch.select(chunk).to(dev)
        out = policy(mb.tokens, mb.cu_seqlens, attn_fn=attn_fn, tap_layers=taps_wanted)  # logits (T, V), taps
        logp = next_token_logp(out.logits, mb.tokens, mb.cu_seqlens, cfg.temperature)
        if on_policy:
            mb = replace(mb, old_logp=logp.detach())
        L_p, st = policy_loss(logp, mb, cfg, n_seqs=n_seqs, n_tokens=n_tokens, n_micro=micro_batches)
        if n_tokens > 0:
            L_p.backward()
        stats["loss_policy"] += float(L_p.detach())
        pstats.append(st)
        for k, tr in enumerate(drafts):
            L_d, dm = draft_loss(tr, out.taps, out.logits, mb)  # teacher softmax(z): untempered
            (tr.lam * L_d / micro_batches).backward()
            stats["loss_draft"][k] += float(L_d.detach()) / micro_batches
            stats["draft_metrics"][k].append(dm)
    stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), policy_grad_clip))
    policy_opt.step()
    for tr in drafts:
        clip_grads_(list(tr.draft.parameters()), tr.grad_clip)
        tr.opt.step()
    n = sum(s["tokens"] for s in pstats)
    for key in ("clip_frac", "k3", "ratio"):
        stats[key] = sum(s[key] * s["tokens"] for s in pstats) / max(n, 1)
    stats["loss_total"] = stats["loss_policy"] + sum(tr.lam * l for tr, l in zip(drafts, stats["loss_draft"]))
    stats["draft_metrics"] = [merge_metrics(ms) for ms in stats["draft_metrics"]]  # every micro-batch, count-weighted
    return stats
