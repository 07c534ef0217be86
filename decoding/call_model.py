"""The slowest row of a batch-synchronous generate call: how many steps it takes at k draft tokens, and how much the
rows differ in acceptance (decoding/adaptive_k.py chooses k by when a call would end).

A call lasts until its slowest row is done. At k each step keeps X = min(kept | k, left) tokens of a row (left: the
most it may still take), P(X >= j) = prod_{i<j} alpha_i, j = 1..min(k + 1, left). A row's steps to `left` tokens are
a renewal count, about normal with mean (left + o) / mu and variance left sigma^2 / mu^3 (mu, sigma^2: X's mean and
variance; o = (E[X^2] - mu) / (2 mu) the last step's overshoot); rows whose drafts are accepted at (1 + rho z) alpha_j
spread by left rho o / mu more; the slowest of n rows lies e_n sd above the mean (e_n = E[max of n standard normals]).

    kept_moments(alphas, k, left)                  E[X], E[X^2]
    expected_max_normal(n)                         e_n
    call_steps(alphas, k, left, n, rho, kappa)     the slowest row's steps
    straggle_ratio(forwards, kept, steps_at_k, ...) kappa from one call: its slowest row against the model
    row_spread(tried, accepted, alphas)            rho^2 from one call's per-row counts

tests/test_adaptive_k.py checks them against enumeration, closed forms and Monte Carlo simulations of the rows.
"""
from __future__ import annotations

import functools
import math


def kept_moments(alphas, k: int, left: int = None) -> tuple:
    """E[X], E[X^2] of X = min(kept | k, left), the tokens a row keeps from one step when it may take `left` more:
    P(X >= j) = prod_{i<j} alpha_i for j = 1..min(k + 1, left), and E[X^2] = sum_j (2j - 1) P(X >= j)."""
    top = k + 1 if left is None else max(1, min(k + 1, left))
    m1, m2, p = 0.0, 0.0, 1.0
    for j in range(1, top + 1):
        p = p * alphas[j - 2] if j > 1 else 1.0
        m1, m2 = m1 + p, m2 + (2 * j - 1) * p
    return m1, m2


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """e_n = E[max of n independent standard normals] = integral x n phi(x) Phi(x)^(n-1) dx (e_1 = 0, e_8 = 1.42,
    e_64 = 2.34), by the trapezoid rule on [-9, 9] with step 0.01 (exact to ~1e-14 for so smooth an integrand: e_2 =
    1 / sqrt(pi), e_3 = 3 / (2 sqrt(pi)))."""
    if n <= 1:
        return 0.0
    total, dx = 0.0, 0.01
    for i in range(1801):
        x = -9.0 + i * dx
        phi, Phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi), 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * phi * Phi ** (n - 1) * (0.5 if i in (0, 1800) else 1.0)
    return total * dx


def call_steps(alphas, k: int, left: int, n: int, rho: float = 0.0, kappa: float = 1.0) -> float:
    """Steps until the slowest of n open rows has `left` more tokens at k. A row's steps to reach `left` tokens with
    steps of X tokens (kept_moments: mean mu, variance sigma^2) are about normal (renewal theory) with mean
    (left + o) / mu, o = (E[X^2] - mu) / (2 mu) the last step's expected overshoot, and variance left sigma^2 / mu^3.
    Rows also differ: a row whose drafts are accepted at (1 + rho z) alpha_j (z standard normal; rho the rows'
    relative spread, AdaptiveK.end) keeps mu (1 + rho o z) a step to first order, since d mu / d ln alpha =
    sum_j (j - 1) P(X >= j) = mu o: its steps spread by left rho o / mu more. The slowest of n rows lies e_n sd above
    the mean, kappa x that where calls measured their slowest rows further out (straggle_ratio):

        steps(k) = max((left + o_k) / mu_k + kappa e_n sqrt(sigma_k^2 left / mu_k^3 + (rho o_k left / mu_k)^2), 1)
                                                                                   (k = 0: exactly `left`)"""
    m1, m2 = kept_moments(alphas, k, left)
    over = (m2 - m1) / (2 * m1)
    return max((left + over) / m1 + kappa * expected_max_normal(n) * row_steps_sd(alphas, k, left, rho), 1.0)


def row_steps_sd(alphas, k: int, left: int, rho: float = 0.0) -> float:
    """The sd of one row's steps to `left` tokens at k (call_steps): sqrt(sigma^2 left / mu^3 + (rho o left / mu)^2)."""
    m1, m2 = kept_moments(alphas, k, left)
    over = (m2 - m1) / (2 * m1)
    return math.sqrt(max(m2 - m1 * m1, 0.0) * left / m1 ** 3 + (rho * over * left / m1) ** 2)


def straggle_ratio(forwards, kept, steps_at_k, alphas, rho: float = 0.0) -> tuple:
    """How far out one call's slowest row lay, against the model: among the rows that took the whole budget (the most
    tokens kept; a row ended by EOS says nothing of straggling), measured max_i f_i - mean_i f_i (f_i: the row's
    verification forwards) over e_n x the model's sd, the sd averaged over the call's steps at k > 0 (steps_at_k)
    -> (ratio, rows used); (0, 0) with fewer than 4 such rows or where k = 0 ran half the call's steps or more."""
    top = max(kept, default=0)
    f = [fi for fi, kp in zip(forwards, kept) if kp == top]
    spec = sum(steps_at_k[1:])
    if len(f) < 4 or top < 1 or spec <= sum(steps_at_k) / 2:
        return 0.0, 0
    sd = sum(c * row_steps_sd(alphas, k, top, rho) for k, c in enumerate(steps_at_k) if k) / spec
    model = expected_max_normal(len(f)) * sd
    return ((max(f) - sum(f) / len(f)) / model, len(f)) if model > 0 else (0.0, 0)


def row_spread(tried, accepted, alphas) -> tuple:
    """The rows' relative spread in acceptance, rho, from one call's per-row counts. Row i tried T_ij drafts at
    position j and accepted A_i of them; were its drafts accepted at alpha_j (1 + rho z_i), it would expect
    E_i = sum_j T_ij alpha_j, so r_i = A_i / E_i spreads across rows by

        var_i(r_i) = rho^2 mean(r)^2 + mean_i(V_i / E_i^2),   V_i = sum_j T_ij alpha_j (1 - alpha_j) (its coin flips)

    over the rows with >= 8 drafts tried. Which positions a row tried -- the k of the steps it ran, where it stopped --
    enters only through E_i: a call whose k changes mid-way (probes first, k = 0 late, run by the rows that finish
    last) is measured like one at a fixed k. (A ratio of kept tokens to forwards per row would mix the rows' k's into
    their acceptance: the rows that run the call's last k = 0 steps would look worse.)
    -> (rho^2, rows used), rho^2 unclipped (noise can make it negative: pooled over calls first, clipped after, it
    stays unbiased); (0, 0) when fewer than 4 rows count, or when they accepted nothing (no spread to measure)."""
    rows = []
    for T, A in zip(tried, accepted):
        E = sum(t * a for t, a in zip(T, alphas))
        if sum(T) >= 8 and E > 0:
            rows.append((A / E, sum(t * a * (1 - a) for t, a in zip(T, alphas)) / (E * E)))
    if len(rows) < 4:
        return 0.0, 0
    mean = sum(r for r, _ in rows) / len(rows)
    if mean <= 0:  # an untrained draft at tau = 0: every row rejected every draft
        return 0.0, 0
    var = sum((r - mean) ** 2 for r, _ in rows) / (len(rows) - 1)
    return (var - sum(v for _, v in rows) / len(rows)) / (mean * mean), len(rows)
