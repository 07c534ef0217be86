"""backends.attention_padded's auto kernels, what the warm-ups and the control arms run: the padded kernel while its
(S, Hq, L, L + P) scores fit PADDED_MAX_SCORES_MIB, the blockwise path (packed_causal_attention; ring_branch_attention
as a ring of one) past it -- the same values and gradients either way (fp64, 1e-10), and the dispatch by size.
Adds ~1 s.
"""
import pytest
import torch

import backends.attention_padded as ap
from branch_mask import cu_seqlens_from_lengths, pad_ring_of_one


def _inputs(P, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = pad_ring_of_one(cu_seqlens_from_lengths([7, 12, 3])).cu_seqlens  # even lengths: a ring of one's layout
    T, Hq, Hkv, D = int(cu[-1]), 4, 2, 8
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x = [rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)]
    return cu, x + ([rnd(T, P, Hkv, D), rnd(T, P, Hkv, D)] if P else [])


def _run(fn, cu, x):
    out = fn(*x[:3], cu, *x[3:], softmax_scale=0.3) if len(x) > 3 else fn(*x[:3], cu, softmax_scale=0.3)
    out.pow(2).sum().backward()
    res = [out.detach()] + [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    return res


@pytest.mark.parametrize("P", [0, 2])
def test_blockwise_past_the_budget_equals_padded(P, monkeypatch):
    cu, x = _inputs(P)
    auto, padded = (ap.auto_branch_attention, ap.padded_branch_attention) if P else \
        (ap.auto_causal_attention, ap.padded_causal_attention)
    want = _run(padded, cu, x)
    monkeypatch.setattr(ap, "PADDED_MAX_SCORES_MIB", 0.0)  # every batch is "long": the blockwise path
    monkeypatch.setattr(ap, "padded_causal_attention", None)  # and the padded kernels are not called
    monkeypatch.setattr(ap, "padded_branch_attention", None)
    for a, b in zip(_run(auto, cu, x), want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_dispatch_by_size():
    cu = cu_seqlens_from_lengths([100, 300])
    need = 4 * 2 * 8 * 300 * (300 + 3) / 2**20  # S x Hq x L x (L + P) fp32, in MiB
    assert ap.padded_fits(cu, 8, 3, max_mib=need) and not ap.padded_fits(cu, 8, 3, max_mib=need * 0.99)
    assert not ap.padded_fits(cu_seqlens_from_lengths([9000]), 32)  # a long rollout: blockwise at the default
