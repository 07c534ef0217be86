"""The speculative-sampling step shared by chain (speculative.py) and tree (speculative_tree.py) drafts.

For a target p and a proposal q over V tokens and a token d drawn from q [Leviathan et al. 2023; Chen et al. 2023]:

    accept d with probability a(d) = min(1, p(d) / q(d));   on a rejection sample from r = norm(max(p - q, 0))

so that sum_d q(d) [a(d) 1{x = d} + (1 - a(d)) r(x)] = p(x) exactly (tests/test_speculative.py enumerates it).
"""
from __future__ import annotations

import torch

from decoding.row_streams import multinomial
from modeling.layers import at_least_f32


def probs(logits, temperature: float):  # (..., V) -> p (..., V) at temperature tau > 0, at least fp32
    return torch.softmax(at_least_f32(logits) / temperature, dim=-1)


def sample(logits, temperature: float, generator=None):
    """(B, V) logits -> tokens (B,) and the probabilities they were drawn from (None at tau = 0: the argmax).
    generator: a torch.Generator, row_streams.RowStreams (one stream per row) or None (torch's global one)."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = probs(logits, temperature)
    return multinomial(q, generator), q


def accept_prob(p_d, q_d):
    """min(1, p(d) / q(d)); 0 where q(d) = 0 (a tree draws past q's support only once q is exhausted: never accept)."""
    return torch.where(q_d > 0, (p_d / q_d.clamp_min(torch.finfo(q_d.dtype).tiny)).clamp(max=1.0), 0.0)


def residual(p, q):
    """norm(max(p - q, 0)) (..., V); where p == q (then nothing is ever rejected) fall back to p."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)
