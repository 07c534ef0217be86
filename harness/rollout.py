"""One RL step's rollouts: G speculative samples per prompt, scored, with group advantages and reference log-probs,
then shared by every rank of the mesh.

    batch, info = rollout(s, mesh, problems)

  1. generate   each DP replica's generating rank (PP stage 0, CP rank 0; in one process: the process) samples G
                responses for its share problems[r::dp] with its full policy + co-trained draft copy
                (speculative.generate: lossless, so they are exact samples of pi_old and their log-probs are pi_old's);
  2. score      rewards from the task, GRPO group advantages (rl_loop.group_advantages);
  3. reference  log pi_ref per token from the frozen reference (k3 penalty and the KL drift): no-grad forwards of
                rollout_batch sequences each, the LM head applied --chunk_mib at a time (no (T, V) logits);
  4. gather     every rank receives the whole batch (all_gather_object; GRPO groups stay whole). With one process
                there is nothing to gather.

`generate` is also what eval_arms.py times: chunks of cfg.rollout_batch rows (the rollout engine's batch).

Letters: B rollout rows, G group size, T packed tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import speculative
from backends.attention_padded import padded_causal_attention
from backends.fused_logprob import budget_rows
from branch_mask import cu_seqlens_from_lengths, seq_lengths
from rl_loop import RolloutBatch, group_advantages, reference_logp

if TYPE_CHECKING:
    from harness.experiment import Setup
    from harness.mesh import Mesh


def generate(s: Setup, draft, prompts: list, seed=None, k=None):
    """speculative.generate over chunks of cfg.rollout_batch rows -> (tokens, logprobs, stats). draft=None: plain
    autoregressive sampling through the same engine. seed: a fresh generator (every eval arm sees the same seed).
    k: draft tokens per step (default cfg.num_draft_tokens). stats: sums, plus per prompt row_kept / row_forwards."""
    c = s.cfg
    gen = s.gen if seed is None else torch.Generator(device=s.gen.device).manual_seed(seed)
    toks, lps, st = [], [], {"row_steps": 0, "kept": 0, "new_tokens": 0, "seconds": 0.0}
    rows = {"row_kept": [], "row_forwards": []}
    for i in range(0, len(prompts), c.rollout_batch):
        r = speculative.generate(s.policy, draft, prompts[i: i + c.rollout_batch],
                                 max_new_tokens=s.task.max_new_tokens,
                                 num_draft_tokens=(k or c.num_draft_tokens) if draft is not None else 0,
                                 temperature=c.temperature, eos_id=s.task.tok.eos_id, generator=gen,
                                 tree=c.tree if not k or k == len(c.tree) else None)  # eval's own k: a chain
        toks += [t.cpu() for t in r.tokens]  # rollouts are scored, packed and exchanged on the host
        lps += [lp.cpu() for lp in r.logprobs]
        for key in st:
            st[key] += getattr(r.stats, key)
        for key in rows:
            rows[key] += getattr(r.stats, key)
    st.update(rows)
    # tokens kept per verification forward (speculative.py); None: there was none (max_new_tokens 1)
    st["accept_len"] = st["kept"] / st["row_steps"] if st["row_steps"] else None
    st["tok_s"] = st["new_tokens"] / max(st["seconds"], 1e-9)
    return toks, lps, st


def rollout_local(s: Setup, problems: list) -> tuple[RolloutBatch, dict]:
    """Steps 1-3 on this rank: G samples per problem -> scored, advantage-weighted RolloutBatch with ref_logp."""
    c = s.cfg
    prompts = [s.task.encode_prompt(p) for p in problems for _ in range(c.group_size)]
    toks, lps, st = generate(s, s.drafts["cotrained"].draft, prompts)
    R, parts = s.task.score([p for p in problems for _ in range(c.group_size)], toks)
    adv, valid = group_advantages(R, c.group_size, std_norm=c.std_norm)
    batch = RolloutBatch.from_rollouts(prompts, toks, lps, adv, valid)
    batch.ref_logp = reference_logp(s.ref, batch, attn_fn=padded_causal_attention, temperature=c.temperature,
                                    logprob_chunk=budget_rows(s.ref.cfg.vocab_size, c.chunk_mib),
                                    seqs=c.rollout_batch)  # rollout_batch sequences per forward, the head in chunks
    info = {"reward": float(R.mean()), "correct": float(parts["correct"].mean()),
            "explicit": explicit_share(parts), "resp_len": st["new_tokens"] / len(prompts),
            "zero_var_groups": int((~valid).sum()) // c.group_size,
            "accept_len": st["accept_len"], "rollout_tok_s": st["tok_s"]}
    return batch, info


def explicit_share(parts: dict) -> float:
    """The built-in task's format term (share of steps written explicitly); HF mode has none: 0."""
    return float(parts["explicit"].mean()) if "explicit" in parts else 0.0


def rollout(s: Setup, mesh: Mesh, problems: list) -> tuple[RolloutBatch, dict]:
    """Steps 1-4: every rank returns the whole step's batch (replica order) and the replicas' mean stats."""
    g = mesh.grid
    part = (g.dp_rank, *rollout_local(s, problems[g.dp_rank::g.dp])) if mesh.generates else None
    if mesh.world == 1:
        return part[1], part[2]
    parts = [None] * mesh.world
    dist.all_gather_object(parts, part)  # sync point: tokens and per-token floats only, small next to the weights
    parts = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    info = {k: _mean([p[2][k] for p in parts]) for k in parts[0][2]}
    info["zero_var_groups"] = sum(p[2]["zero_var_groups"] for p in parts)
    return concat_batches([p[1] for p in parts]), info


def _mean(xs: list):
    """The replicas' mean of a stat; None where a replica has none (an acceptance without verification forwards)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def concat_batches(parts: list) -> RolloutBatch:
    """Packed batches end to end: one batch whose sequences are the parts' in order."""
    cu = cu_seqlens_from_lengths(torch.cat([seq_lengths(b.cu_seqlens) for b in parts]))
    cat = lambda k: torch.cat([getattr(b, k) for b in parts])  # noqa: E731
    return RolloutBatch(cat("tokens"), cu, cat("resp_mask"), cat("old_logp"), cat("adv"), cat("valid"),
                        cat("ref_logp"))
