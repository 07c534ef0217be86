"""decoding/adaptive_k.py and decoding/call_model.py: the cost fit against its written-out reference, the slowest row
against simulations, the choice of k under injected costs (never the wall clock) with simulated and with real
acceptance, and the --num_draft_tokens=auto flag. The lossless checks with k switching mid-generation sit with the
others (test_speculative.py, test_temperature.py: spec_cases.SWITCHING). ~15 s on 2 busy cores."""
import math
import random
import re

import pytest
import torch

from decoding.adaptive_k import AdaptiveK, _bucket, _slopes, step_costs_naive
from decoding.k_control import KSchedule
from decoding.call_model import (call_steps, expected_max_normal, kept_moments, row_spread, row_steps_sd,
                                 straggle_ratio)
from harness.config import parse_args
from spec_cases import make_small_vocab_pair
from speculative import generate

pytestmark = pytest.mark.usefixtures("one_thread")


def expected_kept(alphas, k: int) -> float:
    """The reference: E[kept | k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j, written out."""
    e, p = 1.0, 1.0
    for a in alphas[:k]:
        p *= a
        e += p
    return e


class Sim:
    """Per-position Bernoulli acceptance (alphas) and a cost source: verify a + b r S, draft c_d per draft token."""

    def __init__(self, alphas, a=1.0, b=0.0, cd=0.0, seed=0):
        self.alphas, self.a, self.b, self.cd, self.rng = list(alphas), a, b, cd, random.Random(seed)

    def costs(self, rows, k):
        return self.cd * k, self.a + self.b * rows * (k + 1)

    def run(self, ctl, rows, steps, call=None):
        """`steps` steps at `rows` through ctl's hooks, as engine calls of `call` steps (None: one call) -> the k of
        each."""
        K, ks = ctl.max_k, []
        for i in range(steps):
            if i % (call or steps) == 0:  # a new engine call: its counts start at 0
                ctl.begin(K, rows)
                R, A = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long)
            k = ctl.choose(rows)
            for _ in range(rows):
                for j in range(k):
                    R[j] += 1
                    if self.rng.random() >= self.alphas[j]:
                        break
                    A[j] += 1
            ctl.record(rows, k, R, A)
            ks.append(k)
        return ks

    def run_calls(self, ctl, rows, calls, tokens, call_model=True):
        """Engine calls of `rows` rows that each take `tokens` tokens (a row keeps min(kept, what it may still take)),
        choose() told `left` and the open rows (call_model) or not -> (the k of each step, simulated s per token)."""
        K, ks, seconds = ctl.max_k, [], 0.0
        for _ in range(calls):
            ctl.begin(K, rows, left=tokens if call_model else None)
            R, A, rem = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long), [tokens] * rows
            while max(rem) > 0:
                k = ctl.choose(rows, left=max(rem), open_rows=sum(m > 0 for m in rem)) if call_model else \
                    ctl.choose(rows)
                for i in (i for i in range(rows) if rem[i] > 0):
                    kept = 1
                    for j in range(k):
                        R[j] += 1
                        if self.rng.random() >= self.alphas[j]:
                            break
                        A[j], kept = A[j] + 1, kept + 1
                    rem[i] -= kept
                ctl.record(rows, k, R, A)
                seconds, ks = seconds + sum(self.costs(rows, k)), ks + [k]
        return ks, seconds / (calls * tokens)


def row_steps(alphas, k, left, rng, scale=1.0):
    """The steps one row takes to `left` tokens at k, its drafts accepted at scale x alpha_j (Monte Carlo), and the
    tokens it kept."""
    rem, steps, kept_all = left, 0, 0
    while rem > 0:
        kept = 1
        while kept <= k and rng.random() < min(scale * alphas[kept - 1], 1.0):
            kept += 1
        rem, steps, kept_all = rem - kept, steps + 1, kept_all + min(kept, rem)
    return steps, kept_all


def slowest_row_steps(alphas, k, left, n, rng, reps, rho=0.0):
    """The mean over reps of the steps the slowest of n rows takes to `left` tokens at k, each row's acceptance
    scaled by 1 + rho z (Monte Carlo)."""
    return sum(max(row_steps(alphas, k, left, rng, 1 + rho * rng.gauss(0, 1))[0] for _ in range(n))
               for _ in range(reps)) / reps


def test_the_call_model_against_a_simulation_of_the_slowest_row():
    """kept_moments against the distribution enumerated, e_n against its closed forms (n = 2, 3), and call_steps
    within 5% of a Monte Carlo of the slowest row (2000 row-calls each), where the per-step count left / E[kept]
    misses by more than 10% at batch 16-64. ~2 s."""
    al = [0.9, 0.8, 0.7]
    for k, left in ((3, 100), (3, 2), (2, 5), (0, 7)):
        top = min(k + 1, left)
        p_ge = [math.prod(al[: j - 1]) for j in range(1, top + 1)]  # P(X >= j)
        pmf = [p_ge[j] - (p_ge[j + 1] if j + 1 < top else 0.0) for j in range(top)]  # P(X = j + 1)
        want = (sum((j + 1) * q for j, q in enumerate(pmf)), sum((j + 1) ** 2 * q for j, q in enumerate(pmf)))
        assert kept_moments(al, k, left) == pytest.approx(want, rel=1e-12)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert call_steps(al, 0, 40, 64) == 40.0  # autoregressive: every row in step
    rng = random.Random(0)
    for alphas, k, left, n in (([0.95] * 6, 6, 95, 64), ([0.95] * 6, 3, 95, 64), ([0.72, 0.8], 2, 95, 64),
                               ([0.8] * 4, 4, 40, 16), ([0.9] * 6, 6, 64, 1)):
        sim = slowest_row_steps(alphas, k, left, n, rng, 2000 // n)
        assert call_steps(alphas, k, left, n) == pytest.approx(sim, rel=0.05), (alphas, k, left, n)
        if n > 1:
            assert left / expected_kept(alphas, k) < 0.9 * sim


def row_tries(alphas, ks, left, rng, scale=1.0):
    """One row of a call whose step i runs at ks[i] (the last repeats) until it has `left` tokens, its drafts accepted
    at scale x alpha_j (Monte Carlo), counted as the engine counts them (positions the row keeps): (drafts tried per
    position, accepted)."""
    tried, acc, rem, i = [0] * max(ks), 0, left, 0
    while rem > 0:
        k, n = ks[min(i, len(ks) - 1)], 0
        while n < k and rng.random() < min(scale * alphas[n], 1.0):
            n += 1
        kept = min(n + 1, rem)
        for j in range(min(k, kept)):  # tried: j <= n; accepted: j < n (both among the kept positions)
            tried[j] += j <= n
            acc += j < n
        rem, i = rem - kept, i + 1
    return tried, acc


def test_rows_that_differ_in_acceptance(mismatched):
    """Rows whose acceptance is scaled by 1 + rho z: row_spread recovers rho from the rows' drafts tried / accepted
    (0.1 within 0.03 on 3 x 64 rows; none is found where the rows are alike), at a fixed k and in calls whose k
    changes mid-way (probes first, k = 0 from step 18 on: the rows that finish last run the k = 0 steps); call_steps
    with that rho stays within 6% of a Monte Carlo of the slowest row, where without it it misses by more. ~4 s."""
    rng, alphas = random.Random(1), [0.8, 0.8, 0.8]
    for ks in ([3], [3, 0, 1, 3, 0, 1] + [3] * 12 + [0]):
        for rho, lo, hi in ((0.1, 0.07, 0.13), (0.0, 0.0, 0.03)):
            est = []
            for _ in range(3):
                rows = [row_tries(alphas, ks, 96, rng, 1 + rho * rng.gauss(0, 1)) for _ in range(64)]
                got, n = row_spread([t for t, _ in rows], [a for _, a in rows], alphas)
                est.append(got)  # rho^2, unclipped
                assert n == 64
            assert lo <= math.sqrt(max(sum(est) / 3, 0.0)) <= hi, (ks, rho, est)
    sim = slowest_row_steps(alphas, 3, 95, 64, rng, 30, rho=0.1)
    assert call_steps(alphas, 3, 95, 64, rho=0.1) == pytest.approx(sim, rel=0.06)
    assert call_steps(alphas, 3, 95, 64) < 0.93 * sim
    assert row_spread([[4, 4, 2]] * 3, [8] * 3, alphas) == (0.0, 0)  # too few rows to tell
    assert row_spread([[4, 2, 1]] * 8, [6] * 8, alphas) == (0.0, 0)  # too few drafts per row
    policy, draft = mismatched  # the engine hands each call's rows to the controller (AdaptiveK.end)
    ctl = AdaptiveK(2, costs=lambda rows, k: (0.0, 1.0))
    generate(policy, draft, [torch.tensor([1, 4, 2])] * 8, max_new_tokens=40, num_draft_tokens=2, adapt=ctl,
             generator=torch.Generator().manual_seed(0))
    assert ctl.spread[1] == 8  # all 8 rows counted (each tried >= 8 drafts)


def test_the_call_model_lowers_k_at_large_batch():
    """The same draft (alpha 0.9) and costs at batch 1 and 64, whole calls simulated (Sim.run_calls): the per-step
    rate picks k near the ceiling at both; the call model keeps it high at batch 1 and lowers it at batch 64, where its
    calls end sooner (simulated seconds per token) than the per-step model's (0.76 against 0.82). ~3 s."""
    out = {}
    for rows in (1, 64):
        for call_model in (True, False):
            sim = Sim([0.9] * 6, b=0.25 / rows, cd=0.05, seed=1)
            ks, s_per_token = sim.run_calls(AdaptiveK(6, costs=sim.costs), rows, 30 if rows == 1 else 12, 64,
                                            call_model)
            out[rows, call_model] = max(range(7), key=ks.count), s_per_token
    assert out[1, False][0] >= 5 and out[64, False][0] >= 5
    assert out[1, True][0] >= 4 and out[64, True][0] <= 3, out
    assert out[64, True][1] < 0.97 * out[64, False][1] and out[1, True][1] < 1.03 * out[1, False][1], out


def test_step_costs_equal_the_written_out_reference():
    """The running sums (per batch size and k, lazily decayed) reproduce c(r, k) computed from the explicit list of
    timed steps (fp64, 1e-9), at timed and untimed batch sizes; a k never timed is costed by the fit alone."""
    rng, obs = random.Random(0), []
    ctl = AdaptiveK(5, cost_memory=20.0, bandwidth=0.5, costs=lambda rows, k: obs[-1][2:4])  # the step's own times
    R = torch.zeros(5, dtype=torch.long)
    for _ in range(80):
        rows, k = rng.choice([3, 8, 12, 40]), rng.choice([0, 1, 2, 4])  # k = 3 and 5 never run
        L = rng.choice([None, 10, 11, 40, 300])  # context lengths (10 and 11 share a bucket)
        td, tv = 0.1 * k * (1 + rng.random()), 0.5 + 0.01 * rows * (k + 1) * (L or 20) / 20 + rng.gauss(0, 0.05)
        obs.append((rows, k, td, tv, L))
        ctl.record(rows, k, R, R, ctx=L)
    for r, L in ((3, None), (8, 10), (20, 64), (64, 300), (12, 1000)):
        assert ctl.costs_at(r, L) == pytest.approx(step_costs_naive(obs, r, 5, memory=20.0, h=0.5, ctx=L), rel=1e-9)
    # a step's time is moved along the slope in context: 1 s at context 16 and 2 s at 128 give 1 s at 16, 2 s at 128
    near = [(8, 0, 0.0, 1.0, 16), (8, 0, 0.0, 2.0, 128)]
    assert step_costs_naive(near, 8, 0, 1e12, 0.35, ctx=16)[0] < 1.01
    assert step_costs_naive(near, 8, 0, 1e12, 0.35, ctx=128)[0] > 1.99
    # a slope in context that is a line in S (k = 0 / 1 / 3 grow by 0.07 / 0.09 / 0.13 s per position): recovered
    # exactly, and without shrinkage (m = 0) each k costs its own line's time at a context none ran at
    lines = [(8, k, 0.0, 1.0 + 0.5 * k + (0.05 + 0.02 * (k + 1)) * L, L) for k in (0, 1, 3)
             for L in (16, 32, 64, 128)]
    per_k = {}
    for _, k, _, t, L in lines:
        e = per_k.setdefault(k, [0.0] * 6)
        for i, v in enumerate((1.0, t, L, L * L, L * t, 1.0)):
            e[i] += v
    assert _slopes(per_k) == pytest.approx({0: 0.07, 1: 0.09, 3: 0.13}, rel=1e-9)
    c = step_costs_naive(lines, 8, 3, 1e12, 0.35, m=0.0, ctx=256)
    assert [c[k] for k in (0, 1, 3)] == pytest.approx([1.0 + 0.5 * k + (0.05 + 0.02 * (k + 1)) * 256
                                                       for k in (0, 1, 3)])
    # two steps at one size: the line through them, and each k's own mean pulled towards it by m = 2 pseudo-steps
    assert step_costs_naive([(8, 1, 0.0, 1.0, None), (8, 3, 0.0, 2.0, None)], 8, 3, 1e12, 0.5) == pytest.approx(
        [0.5, (1.0 + 2 * 1.0) / 3, 1.5, (2.0 + 2 * 2.0) / 3])
    assert kept_moments([0.5, 0.5, 1.0], 3)[0] == 1 + 0.5 + 0.25 + 0.25 == expected_kept([0.5, 0.5, 1.0], 3)
    assert kept_moments([0.9], 0)[0] == 1.0


@pytest.mark.parametrize("alphas, b, cd, want", [
    ([0.95] * 6, 0.0, 0.01, {6}),  # a good draft, a flat verify (batch 1 on a CPU): the ceiling
    ([0.3] * 6, 0.02, 0.1, {0}),  # a mismatched draft, verify cost per token: autoregressive
    ([0.8] * 6, 0.02, 0.1, {2, 3}),  # in between, E / c peaks inside: k = 1..4 0.756, 0.782, 0.765, 0.731
])
def test_k_settles_where_the_cost_model_peaks(alphas, b, cd, want):
    sim = Sim(alphas, b=b, cd=cd)
    ctl = AdaptiveK(6, costs=sim.costs, explore_every=10 ** 6)
    ks = sim.run(ctl, rows=32, steps=200)
    assert set(ks[:6]) == {6, 0, 1}  # the probes first
    assert set(ks[-50:]) <= want, ks[-50:]


@pytest.mark.parametrize("margin", [0.1, 0.0])
def test_speculation_must_beat_k0_by_the_margin(margin):
    """k = 1 predicted 5% faster than k = 0 (E[kept] 1.5 for 1.4286 of the cost): under a 10% margin k stays 0 (the
    margin stands for speculation's prefill and catch-up costs, which the model leaves out), exploring the best k > 0
    (1) at the start of a call now and then; with no margin it speculates (a neighbour, k = 0 or 2, every 32 steps)."""
    sim = Sim([0.5, 0.0], cd=1.5 / 1.05 - 1.0)
    ctl = AdaptiveK(2, costs=sim.costs, margin=margin)
    tail = sim.run(ctl, 64, 600, call=30)[-150:]
    assert (tail.count(0) >= 145) if margin else (tail.count(1) >= 140), tail


def test_k_follows_a_drifting_draft_and_k0_still_explores():
    """The draft falls out of step mid-run (acceptance 0.95 -> 0.2): k drops from the ceiling to 0 within the
    acceptance memory; at 0 a call runs dormant (k = 0 throughout) unless explore_off (here 40) steps ran at 0 since
    speculation last ran: then its first step runs the best k > 0 (here 1) and the rest none; when the draft
    recovers, k rises."""
    # at 0.95: k = 4 (E / c = 1.26, k = 3: 1.21); at 0.2: k = 0 (0.68, k = 1: 0.60)
    sim = Sim([0.95] * 4, b=0.03, cd=0.05)
    ctl = AdaptiveK(4, costs=sim.costs, accept_memory=200.0, explore_every=10, explore_off=40)
    assert sim.run(ctl, 16, 100, call=20)[-20:].count(4) >= 18  # one exploring step at k = 3 in every 10
    sim.alphas = [0.2] * 4
    ks = sim.run(ctl, 16, 400, call=20)
    tail = ks[-120:]  # the last 6 calls of 20 steps: every third explores at its first step (19, 39, 59 >= 40 off)
    assert [sum(tail[i: i + 20]) for i in range(0, 120, 20)] in ([1, 0, 0] * 2, [0, 1, 0] * 2, [0, 0, 1] * 2), tail
    assert all(k == 0 for i, k in enumerate(tail) if i % 20) and ctl.dormant
    sim.alphas = [0.95] * 4
    assert sim.run(ctl, 16, 400, call=20)[-20:].count(4) >= 18


def test_kappa_measures_how_far_out_the_slowest_row_lies():
    """straggle_ratio on simulated calls of 64 rows (Monte Carlo): alike rows, as the model assumes, average ~1
    (within 0.2 over 12 calls); rows spread by rho = 0.1, the model told so, ~1.2 (rho's first-order term is short, and
    kappa takes that in too); rows twice as spread as the model's sd give ~2; rows ended by EOS (fewer tokens kept)
    and calls mostly at k = 0 say nothing. Fed to AdaptiveK.end, the pooled kappa moves from 1 towards the calls'
    ratio, and call_steps grows by (kappa - 1) e_n sd. ~1 s."""
    rng, alphas = random.Random(2), [0.8, 0.85, 0.9]
    for rho, lo, hi in ((0.0, 0.8, 1.2), (0.1, 1.0, 1.45)):  # rho's first-order term is ~20% short: kappa ~1.2
        got = []
        for _ in range(12):
            rows = [row_steps(alphas, 3, 95, rng, 1 + rho * rng.gauss(0, 1)) for _ in range(64)]
            got.append(straggle_ratio([f for f, _ in rows], [kp for _, kp in rows], [0, 0, 0, 30], alphas, rho)[0])
        assert lo <= sum(got) / len(got) <= hi, (rho, got)
    mean, sd = (95 + 0.5) / kept_moments(alphas, 3)[0], row_steps_sd(alphas, 3, 95)
    wide = [[mean + 2 * sd * rng.gauss(0, 1) for _ in range(64)] for _ in range(12)]
    ratios = [straggle_ratio(f, [95] * 64, [0, 0, 0, 30], alphas)[0] for f in wide]
    assert sum(ratios) / 12 == pytest.approx(2.0, abs=0.3), ratios
    assert straggle_ratio(wide[0][:8] + [1.0] * 56, [95] * 8 + [40] * 56, [0, 0, 0, 30], alphas)[1] == 8  # EOS rows out
    assert straggle_ratio(wide[0], [95] * 64, [40, 0, 0, 30], alphas) == (0.0, 0)  # k = 0 ran most of the call
    ctl = AdaptiveK(3, costs=lambda rows, k: (0.0, 1.0))
    ctl.chosen = [0, 0, 0, 30]  # the call's steps (begin took at_begin = 0)
    st = type("Stats", (), dict(row_tried=[], row_accepted=[], row_forwards=wide[1], row_kept=[95] * 64))
    for _ in range(20):
        ctl.end(type("Rollout", (), {"stats": st}))
    ratio = straggle_ratio(wide[1], [95] * 64, [0, 0, 0, 30], ctl.alphas())[0]  # at the controller's alphas
    assert 1.0 < ctl.kappa() < ratio and ctl.kappa() == pytest.approx(ratio, rel=0.1)  # the prior's 64 rows left
    extra = call_steps(alphas, 3, 95, 64, kappa=2.0) - call_steps(alphas, 3, 95, 64)
    assert extra == pytest.approx(expected_max_normal(64) * sd)


def test_a_slow_spell_of_the_machine_moves_every_k_alike():
    """The machine runs 1.5x slower for one call of 40 steps, then at its pace again. The k run during the spell (here
    1-3) must not keep the spell's costs once it is over, while the k not run since keep theirs:
    each step is stored at the machine's common pace (recent steps' log times against their cells' means), so after
    the spell every k's cost is within 5% of the truth and k is what it was before the spell (2). Without the pace
    (pace_memory = inf) a k timed last in the spell stays dear (here 10%). ~1 s."""
    def spell(pace_memory):
        sim = Sim([0.8] * 4, b=0.03, cd=0.15)
        pace, true = [1.0], sim.costs
        sim.costs = lambda rows, k: tuple(pace[0] * x for x in true(rows, k))
        ctl = AdaptiveK(4, costs=sim.costs, pace_memory=pace_memory)
        before = sim.run(ctl, 16, 200, call=40)[-40:]
        pace[0] = 1.5
        sim.run(ctl, 16, 40, call=40)
        pace[0] = 1.0
        after = sim.run(ctl, 16, 200, call=40)[-40:]
        return before, after, [c / sum(true(16, k)) for k, c in enumerate(ctl.costs_at(16))]

    before, after, ratio = spell(16.0)
    assert before.count(2) >= 36 and after.count(2) >= 36, (before, after)
    assert ratio == pytest.approx([1.0] * 5, rel=0.05)  # a k explored early in the spell, before the pace caught up
    assert max(spell(float("inf"))[2]) > 1.08  # the control: the timings of k run in the spell kept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_pace_does_not_drift_on_a_steady_machine(seed):
    """A steady machine, each step's time noisy (log-normal, sd 0.25 as on this VM): 200 steps at k = 0, 200 at
    k = 3, then 2600 at k = 1. The pace must stay near 1 and the k not run for 2600 steps keep their costs next to the
    one run (within 12%): the pace compares a step's log time with its cell's mean log time (no Jensen bias: the log
    of an arithmetic mean is ~sd^2 / 2 above the mean log, and would push the pace down every step) and is pulled
    back to 1 over pace_anchor steps (its estimate is otherwise a random walk). ~0.5 s each."""
    rng = random.Random(seed)
    true = [5.2, 5.5, 6.0, 6.5, 7.0]
    ctl = AdaptiveK(4, costs=lambda rows, k: (0.0, true[k] * 1e-3 * math.exp(rng.gauss(0.0, 0.25))))
    z = torch.zeros(4)
    for step in range(3000):
        ctl.record(8, 0 if step < 200 else 3 if step < 400 else 1, z, z, ctx=50)
    ratio = [ctl.costs_at(8, 50)[k] * 1e3 / true[k] for k in (0, 1, 3)]  # the k that ran (the rest: the line's)
    assert abs(ctl.pace) < 0.15, ctl.pace
    assert max(ratio) / min(ratio) < 1.12, ratio  # every k alike (each ~3% high: a mean of log-normal times)


def test_the_engine_times_steps_with_the_injected_clock(mismatched, monkeypatch):
    """A clock whose i-th reading is i^2 s (no wall time; every interval a different length). The controller reads it
    when a call's first step is chosen and once at the end of every step (record): the fit holds the first step from
    its choice and every later one whole, from the end of the step before (stored as timed: the pace held at 1)."""
    policy, draft = mismatched
    readings, seen = [], []

    def clock():
        readings.append(float(len(readings) ** 2))
        return readings[-1]
    ctl = AdaptiveK(2, clock=clock, pace_memory=math.inf)
    record = ctl.record
    monkeypatch.setattr(ctl, "record", lambda rows, k, R, A, ctx: (seen.append((rows, k, ctx, len(readings))),
                                                                   record(rows, k, R, A, ctx)))
    generate(policy, draft, [torch.tensor([1, 4, 2])] * 3, max_new_tokens=12, num_draft_tokens=2, adapt=ctl,
             generator=torch.Generator().manual_seed(0))
    assert [k for _, k, _, _ in seen[:6]] == [2, 0, 1, 2, 0, 1]  # the probes
    assert len(readings) == len(seen) + 1 and [i for *_, i in seen] == list(range(1, len(seen) + 1))
    ctx = [L for _, _, L, _ in seen]  # each step's context: the longest row's cached positions (prompt 3 + kept)
    assert 3 <= ctx[0] < ctx[-1] <= 3 + 12 + 2 + 1
    want = {}  # what the fit should hold per (rows, context bucket, k): [sum w, sum w t], w = exp(age / cost_memory)
    for age, (rows, k, L, i) in enumerate(seen, start=1):
        t = readings[i] - readings[i - 1]  # 2 i - 1 s
        e = want.setdefault((rows, _bucket(L), k), [0.0, 0.0])
        e[0], e[1] = e[0] + math.exp(age / ctl.cost_memory), e[1] + math.exp(age / ctl.cost_memory) * t
    got = {(r, b, k): e[1] / e[0] for (r, b), by_k in ctl.timed.items() for k, e in by_k.items()}
    assert got == pytest.approx({key: wt / w for key, (w, wt) in want.items()}, rel=1e-12)
    with pytest.raises(ValueError, match="ceiling K=2"):
        ctl.begin(3)
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveK(0)


@pytest.fixture(scope="module")
def mismatched():
    return make_small_vocab_pair()


@pytest.mark.parametrize("verify_per_token, draft_cost, rows, want", [(1.0, 0.2, 12, 0), (0.0, 0.0, 1, 4)])
def test_generate_with_a_mismatched_draft_moves_k_the_right_way(mismatched, verify_per_token, draft_cost, rows, want):
    """The real engine, the deliberately mismatched draft (most drafts rejected) and injected costs: when a verified
    token costs as much as a step, k goes to 0 (autoregressive); when drafting and verifying more are free, to K (at
    batch 1: with 12 rows the slowest row gains ~1% from such a draft, inside the margin)."""
    policy, draft = mismatched
    costs = lambda rows, k: (draft_cost * k, 1.0 + verify_per_token * (k + 1))  # noqa: E731
    ctl = AdaptiveK(4, costs=costs, explore_every=10 ** 6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor([1, 4, 2]), torch.tensor([3, 0]), torch.tensor([5, 5, 1, 2])] * 4
    for i in range(3 if rows == 12 else 12):
        r = generate(policy, draft, prompts if rows == 12 else prompts[i: i + 1], max_new_tokens=24, num_draft_tokens=4,
                     temperature=1.0, generator=g, adapt=ctl)
        assert sum(len(t) for t in r.tokens) == rows * 24
    alpha = ctl.alphas()
    assert alpha[0] < 0.7  # mismatched indeed
    assert ctl.best(rows) == want and ctl.chosen[want] > sum(ctl.chosen) / 2, ctl.chosen
    # the choice is the cost model's argmax with the measured acceptance
    rates = [expected_kept(alpha, k) / (1.0 + verify_per_token * (k + 1) + draft_cost * k) for k in range(5)]
    assert max(range(5), key=lambda k: rates[k]) == want and not math.isnan(sum(rates))


def test_auto_flag():
    c = parse_args(["--preset=test", "--num_draft_tokens=auto", "--max_draft_tokens=5"])
    assert (c.num_draft_tokens, c.max_draft_tokens, c.eval_k) == ("auto", 5, 5)  # eval keeps a fixed k
    assert parse_args(["--num_draft_tokens=auto", "--eval_draft_tokens=3"]).eval_k == 3
    assert parse_args(["--num_draft_tokens=3"]).num_draft_tokens == 3
    for bad, msg in ((["--num_draft_tokens=often"], "--num_draft_tokens=often: expected >= 1, or auto"),
                     (["--max_draft_tokens=0"], "--max_draft_tokens=0: expected in [1, 16]"),
                     (["--num_draft_tokens=auto", "--tree=2,1"], "--tree=2,1: expected")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_args(bad)


def test_the_rollouts_report_the_k_auto_ran(mismatched):
    """harness.rollout.generate under --num_draft_tokens=auto: one controller made on first use and kept, the steps
    of each call at each k in the stats, their mean k in a step's metrics (k_mean); a fixed k reports None."""
    from types import SimpleNamespace

    from harness.rollout import auto_k_mean, generate as rollout_generate
    policy, draft = mismatched
    cfg = SimpleNamespace(num_draft_tokens="auto", max_draft_tokens=3, rollout_batch=4, temperature=1.0, tree=())
    s = SimpleNamespace(cfg=cfg, adapt=None, policy=policy, gen=torch.Generator(),
                        task=SimpleNamespace(max_new_tokens=8, tok=SimpleNamespace(eos_ids=[])))
    prompts, keys = [torch.tensor([1, 4, 2])] * 6, torch.arange(6)
    _, _, st = rollout_generate(s, draft, prompts, keys)  # two calls: 4 + 2 rows
    first = s.adapt
    assert isinstance(first, AdaptiveK) and sum(st["steps_at_k"]) == sum(first.chosen) > 0
    _, _, st2 = rollout_generate(s, draft, prompts, keys)
    assert s.adapt is first and [a + b for a, b in zip(st["steps_at_k"], st2["steps_at_k"])] == first.chosen
    mean = auto_k_mean([st["steps_at_k"], st2["steps_at_k"]])
    assert mean == sum(k * n for k, n in enumerate(first.chosen)) / sum(first.chosen) and 0 <= mean <= 3
    cfg.num_draft_tokens = 2
    assert rollout_generate(s, draft, prompts, keys)[2]["steps_at_k"] is None and auto_k_mean([None]) is None


def test_a_call_that_starts_dormant_is_plain_sampling_without_the_draft(mismatched, monkeypatch):
    """KSchedule(off_after=0) as AdaptiveK does when k* = 0 at a call's start: no draft forward at all (not even its
    prefill) and, from the same row streams, exactly the tokens and log-probs of autoregressive sampling."""
    policy, draft = mismatched
    prompts = [torch.tensor([1, 4, 2]), torch.tensor([3, 0]), torch.tensor([5, 5, 1, 2])]
    kw = dict(max_new_tokens=10, temperature=1.0, eos_id=5)
    ref = generate(policy, None, prompts, generator=torch.Generator().manual_seed(3), **kw)
    for name in ("extend", "step", "target_logits"):  # every draft forward of a chain goes through these
        monkeypatch.setattr(type(draft), name, lambda *a, **k: pytest.fail("the draft ran"))
    got = generate(policy, draft, prompts, num_draft_tokens=2, adapt=KSchedule((2,), off_after=0),
                   generator=torch.Generator().manual_seed(3), **kw)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in ref.tokens]
    assert all(torch.equal(a, b) for a, b in zip(got.logprobs, ref.logprobs)) and got.stats.drafted == 0


def test_row_spread_of_rows_that_accepted_nothing_is_no_measurement():  # ~0 s
    """An untrained draft at tau = 0 can see every row reject every draft: rho is undefined (its mean is 0), so the
    call counts no rows instead of dividing by zero."""
    tried = [[4, 4, 4]] * 6
    assert row_spread(tried, [0] * 6, [0.5, 0.4, 0.3]) == (0.0, 0)
    assert row_spread(tried, [2, 3, 2, 3, 2, 3], [0.5, 0.4, 0.3])[1] == 6  # the control: those rows count
