"""attention_flash on any machine: the Segment -> flash-attn varlen translation (varlen_plan) must cover exactly the
(query row, key row) pairs of the segments under flash-attn's own causal convention (bottom-right aligned); the
out' that carries our delta into flash-attn's backward must give dO.out' = delta; and backend="flash" without
flash_attn or CUDA must fail with an error that names it. The flash-attn calls themselves: tests/test_attention_gpu.py.
"""
from collections import Counter

import pytest
import torch

from backends import attention_flash  # noqa: F401  (registers backend "flash")
from attention_cp import Segment
from attention_cp import ring_branch_attention
from backends.attention_flash import out_for_delta, varlen_plan


def _pairs_of_segments(segments):
    """Multiset of (query row, key row) our Segments attend: causal = top-left aligned (k - k0 <= q - q0)."""
    return Counter((i, j) for s in segments for i in range(s.q0, s.q1) for j in range(s.k0, s.k1)
                   if not s.causal or j - s.k0 <= i - s.q0)


def _pairs_of_plans(plans):
    """Multiset of (query row, key row) flash-attn attends for these varlen calls, with its documented causal mask:
    query i of a sequence sees key j iff j <= i + n_k - n_q (aligned at the bottom right)."""
    got = Counter()
    for p in plans:
        rows = lambda r, n: list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()  # noqa: E731
        q_rows, k_rows = rows(p.q_rows, None), rows(p.k_rows, None)
        cq, ck = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
        assert p.cu_seqlens_q.dtype == p.cu_seqlens_k.dtype == torch.int32 and cq[0] == ck[0] == 0
        assert cq[-1] == len(q_rows) and ck[-1] == len(k_rows) and len(cq) == len(ck)
        assert p.max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        assert p.max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
        assert len(set(q_rows)) == len(q_rows), "a query row twice in one call: the merge would write it once"
        for b in range(len(cq) - 1):
            nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            for i in range(nq):
                for j in range(nk):
                    if not p.causal or j <= i + nk - nq:
                        got[(q_rows[cq[b] + i], k_rows[ck[b] + j])] += 1
    return got


SEGMENT_LISTS = {
    "ring_step0": [Segment(0, 12, 0, 12, True), Segment(12, 36, 12, 36, True)],
    "ring_full": [Segment(0, 12, 0, 6, False), Segment(12, 36, 12, 24, False)],
    "ring_half": [Segment(6, 12, 0, 12, False), Segment(24, 36, 12, 36, False)],
    "causal_more_queries": [Segment(0, 30, 3, 12, True)],
    "causal_more_keys": [Segment(5, 9, 0, 36, True)],
    "mixed_overlapping_empty": [Segment(0, 20, 0, 9, True), Segment(4, 14, 0, 36, True), Segment(20, 36, 0, 5, False),
                                Segment(7, 7, 0, 3, False), Segment(3, 9, 4, 4, True)],
}


@pytest.mark.parametrize("name", SEGMENT_LISTS)
def test_varlen_plan_covers_exactly_the_segments_pairs(name):
    segments = SEGMENT_LISTS[name]
    plans = varlen_plan(segments)
    assert _pairs_of_plans(plans) == _pairs_of_segments(segments)
    assert all(all(s.q1 - s.q0 == s.k1 - s.k0 for s in p.segments) for p in plans if p.causal)  # squared


def test_ring_steps_need_no_gather():
    """The ring's step 0 and 'src before me' steps cover contiguous rows: q_var and k_var are views, not copies."""
    step0, full, half = (varlen_plan(SEGMENT_LISTS[n]) for n in ("ring_step0", "ring_full", "ring_half"))
    assert len(step0) == 1 and step0[0].causal and step0[0].q_rows == slice(0, 36) == step0[0].k_rows
    assert step0[0].cu_seqlens_q.tolist() == [0, 12, 36] == step0[0].cu_seqlens_k.tolist()
    assert len(full) == 1 and not full[0].causal and full[0].q_rows == slice(0, 36)
    assert full[0].k_rows.tolist() == list(range(0, 6)) + list(range(12, 24))
    assert full[0].cu_seqlens_k.tolist() == [0, 6, 18]
    assert half[0].q_rows.tolist() == list(range(6, 12)) + list(range(24, 36)) and half[0].k_rows == slice(0, 36)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_for_delta_carries_delta(dtype):
    g = torch.Generator().manual_seed(0)
    do = (torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 1, 64).view(64, 1, 1)).to(dtype)
    delta = torch.randn(64, 4, generator=g) * 3
    out = out_for_delta(do, delta)
    assert out.dtype == dtype
    got = (do.float() * out.float()).sum(-1)  # what flash-attn computes from it (fp32 accumulation)
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert bool(((got - delta).abs() <= eps * delta.abs() + 1e-6).all())
    do[3, 1] = 0
    delta[3, 1] = 0
    assert out_for_delta(do, delta) is not None  # dO = 0 and delta = 0: nothing to carry
    delta[3, 1] = 0.5
    assert out_for_delta(do, delta) is None  # dO = 0 but delta != 0: impossible, PyTorch fallback


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_unavailable_flash_names_backend_and_what_is_missing():
    T, H, D = 8, 2, 16
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match=r'backend="flash" is unavailable.*(flash_attn package|CUDA)') as e:
        ring_branch_attention(q, k, v, torch.tensor([0, T], dtype=torch.int32), backend="flash")
    assert "CUDA" in str(e.value)
