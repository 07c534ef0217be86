"""--rollout_engine vllm: the step's rollouts come from vLLM (serving/vllm_engine.py) with the co-trained draft.

What production RL systems do (NeMo-RL): the trainer refits the engine with its policy and draft before each step's
rollouts, the engine generates, and the token log-probs GRPO needs are recomputed by the trainer's own policy forward
(the engine's are never used: log p_tau(x_t | x_<t) from softmax(logits / tau), rl_loop.next_token_logp). Here,
before its samples are used the engine passes serving/engine_check's losslessness check (the CPU build's expand
workaround applied only if needed), and after every refit its draft's and policy's checksums must equal the
trainer's (engine_check.verify_refit, verify_policy_refit: a stale draft or policy stops the run in one line). Each
step's record carries `accept_len` counted as cospec's engine counts it (a row's tokens up to its EOS), the engine's
own acceptance (vLLM's counters, which count a stopping step whole) and the checksums (`engine_accept`, `engine_sum`,
`engine_policy_sum`), and a line when that acceptance is more than ENGINE_GAP_TOL from the co-trained draft's
teacher-forced tau-hat on the step's rollouts (`engine_gap`).
cospec's own engine stays the default and the reference (--rollout_engine home): every eval arm runs on it. With
--no_spec (plain GRPO, the e2e baseline) the worker holds the plain engine alone and only the policy is refit.

    python train.py --model serve --rollout_engine vllm     # needs vLLM's environment (bash .ci/vllm_env.sh)

One process only (world size 1): the worker holds one copy of the policy and the draft. Memory: a row's (L, V)
logits exist once per row during the recompute.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from rl_loop import next_token_logp
from serving.engine_check import checked_engine, verify_policy_refit, verify_refit
from serving.export import write_servables

if TYPE_CHECKING:
    from harness.experiment import Setup

# |engine acceptance - the co-trained draft's teacher-forced tau-hat on the same step's rollouts| above this is
# reported in one line each step (train.py): a stale or wrong draft in the engine. Both estimate the T = 1 acceptance
# at k = ttt_passes; one step's rollouts leave ~0.2 between them (2.26 vs 2.08 on the test's pair, 8 rows)
ENGINE_GAP_TOL = 0.5


def start_engine(s: Setup, out_dir: str, log=print):
    """The engine over the run's current policy and rollout draft (exported to <out_dir>/engine_start), checked for
    losslessness on 8 held-out prompts; --no_spec: the plain engine alone (autoregressive: nothing to check).
    -> the VllmEngine."""
    from serving.vllm_engine import VllmEngine
    c, draft = s.cfg, None if s.cfg.no_spec else s.drafts["cotrained"].draft
    paths = write_servables(os.path.join(out_dir, "engine_start"), s.policy, draft, step=0, require_draft=not c.no_spec)
    eng = VllmEngine(paths["policy"], paths["draft"], k=int(c.num_draft_tokens),
                     max_model_len=s.policy.cfg.max_position_embeddings)
    if draft is None:
        log(f"rollout engine: vLLM without a draft (plain GRPO), started in {sum(eng.started.values()):.0f}s")
        return eng
    prompts = [s.task.encode_prompt(p).tolist() for p in s.eval_problems[:8]]
    r = checked_engine(eng, prompts, stop=s.task.tok.eos_ids)
    log(f"rollout engine: vLLM, started in {sum(eng.started.values()):.0f}s; losslessness check passed (support "
        f"{r['support']:.3f}, TV {r['tv']:.3f}; expand workaround {'applied' if r['workaround'] else 'not needed'})")
    return eng


def refit_engine(s: Setup) -> dict:
    """The trainer's policy and draft into the running engine; both checksums verified. -> record fields."""
    t0 = time.perf_counter()
    rec = {"engine_policy_sum": verify_policy_refit(s.engine, s.policy, s.engine.refit_policy(s.policy))}
    if not s.cfg.no_spec:
        draft = s.drafts["cotrained"].draft
        rec["engine_sum"] = verify_refit(s.engine, draft, s.engine.refit_draft(draft))
    return {**rec, "engine_refit_s": time.perf_counter() - t0}


def recompute_logp(policy, prompt: torch.Tensor, toks: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) log p_tau of each generated token under the trainer's policy (one packed forward over prompt + toks)."""
    x = torch.cat([prompt, toks]).to(next(policy.parameters()).device)
    cu = torch.tensor([0, x.numel()], dtype=torch.int32, device=x.device)
    with torch.no_grad():
        logits = policy(x, cu).logits  # (L, V): one row's, see the module docstring
    return next_token_logp(logits, x, cu, temperature)[prompt.numel():].float().cpu()


def engine_generate(s: Setup, prompts: list, keys: torch.Tensor) -> tuple:
    """harness/rollout.generate's contract from the engine: (tokens, log-probs, stats); row i's seed from keys[i]."""
    c = s.cfg
    out = s.engine.generate([p.tolist() for p in prompts], temperature=c.temperature,
                            max_tokens=s.task.max_new_tokens, stop=s.task.tok.eos_ids,
                            seeds=[int(k) % (2 ** 31) for k in keys], spec=not c.no_spec)
    toks = [torch.tensor(t[0], dtype=torch.long) for t in out.tokens]
    lps = [recompute_logp(s.policy, p.cpu(), t, c.temperature) for p, t in zip(prompts, toks)]
    # kept as cospec's engine counts it (up to EOS / max_tokens, so accept_len compares across engines); vLLM's own
    # counter, which counts a stopping step whole, is engine_accepted (speculative.py's docstring)
    st = {"row_steps": out.drafts, "kept": out.kept if out.drafts else 0, "new_tokens": sum(t.numel() for t in toks),
          "seconds": out.wall_s, "row_kept": [], "row_forwards": [], "steps_at_k": None,
          "engine_accepted": out.accepted}
    st["accept_len"] = out.acceptance_length_cut
    st["tok_s"] = st["new_tokens"] / max(out.wall_s, 1e-9)
    return toks, lps, st
