"""branch_mask.py: padding and zigzag layout, the CP-aware shift (sharded == unsharded, fwd and grad), the two TTT
mask conventions (same attention up to a permutation of rows), tree masks, errors."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from attention_cp import reference_branch_attention
from branch_mask import (branch_attention_mask, causal_mask, check_cp_padded, cp_shift, cu_seqlens_from_lengths,
                         pad_for_cp, position_ids, seq_lengths, shift_packed, tree_mask, ttt_labels, ttt_mask,
                         ttt_row_map, zigzag_index, zigzag_shard, zigzag_unshard)
from parallel.ring import run_ranks

lengths_st = st.lists(st.integers(1, 17), min_size=1, max_size=4)


@given(lengths_st, st.integers(1, 5))
def test_padding_and_zigzag_layout(lengths, cp):
    cu = cu_seqlens_from_lengths(lengths)
    pad = pad_for_cp(cu, cp)
    L = seq_lengths(pad.cu_seqlens)
    assert bool((L % (2 * cp) == 0).all()) and bool((L - torch.tensor(lengths) < 2 * cp).all())
    x = torch.arange(int(cu[-1])) + 100
    assert torch.equal(pad.unpad(pad.pad(x, fill=-1)), x)
    assert int((pad.pad(x, fill=-1) == -1).sum()) == int(pad.cu_seqlens[-1] - cu[-1])
    idx = [zigzag_index(pad.cu_seqlens, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(int(pad.cu_seqlens[-1])))  # a partition
    xp = pad.pad(x)
    assert torch.equal(zigzag_unshard([zigzag_shard(xp, pad.cu_seqlens, cp, r) for r in range(cp)], pad.cu_seqlens), xp)
    for r in range(cp):  # the pinned layout: per sequence chunk r then chunk 2cp-1-r
        pos, start = position_ids(pad.cu_seqlens)[idx[r]], 0
        for Ls in L.tolist():
            C, n = Ls // (2 * cp), Ls // cp
            want = torch.cat([torch.arange(r * C, (r + 1) * C), torch.arange((2 * cp - 1 - r) * C, (2 * cp - r) * C)])
            assert torch.equal(pos[start:start + n], want)
            start += n


@given(lengths_st, st.integers(1, 4), st.integers(-9, 9), st.booleans(), st.integers(0, 999))
def test_cp_shift_equals_unsharded_shift_and_its_gradient(lengths, cp, d, real_lengths, seed):
    pad = pad_for_cp(cu_seqlens_from_lengths(lengths), cp)
    cu, T = pad.cu_seqlens, int(pad.cu_seqlens[-1])
    lens = pad.lengths if real_lengths else None  # validity by real lengths (padding never read) or padded ones
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(T, 3, generator=g, dtype=torch.float64), torch.randn(T, 3, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want, want_valid = shift_packed(xr, cu, d, fill=-5.0, lengths=lens)
    (want * dy).sum().backward()

    def rank(ring):
        xs = zigzag_shard(x, cu, cp, ring.rank).requires_grad_()
        y, valid = cp_shift(xs, cu, d, group=ring, fill=-5.0, lengths=lens)
        (y * zigzag_shard(dy, cu, cp, ring.rank)).sum().backward()
        return y.detach(), valid, xs.grad

    res = run_ranks(cp, rank)
    got = [zigzag_unshard([r[i] for r in res], cu) for i in range(3)]
    assert torch.equal(got[0], want.detach()) and torch.equal(got[1], want_valid)
    assert torch.equal(got[2], xr.grad)
    tokens = torch.arange(T)  # integer tensors (token ids) shift too; group=None is the unsharded case
    assert torch.equal(cp_shift(tokens, cu, d, fill=-1, lengths=lens)[0],
                       shift_packed(tokens, cu, d, fill=-1, lengths=lens)[0])


def test_shift_semantics_by_hand():
    cu = cu_seqlens_from_lengths([4, 2])
    y, valid = shift_packed(torch.arange(6), cu, 1, fill=-1)
    assert y.tolist() == [1, 2, 3, -1, 5, -1] and valid.tolist() == [True, True, True, False, True, False]
    y, _ = shift_packed(torch.arange(6), cu, -2, fill=-1, lengths=[3, 2])
    assert y.tolist() == [-1, -1, 0, 1, -1, -1]  # row 3 is padding of seq 0: its source x_1 exists, but it is invalid


@settings(max_examples=20)
@given(lengths_st, st.integers(1, 4), st.integers(0, 999))
def test_ttt_conventions_are_the_same_attention_up_to_row_permutation(lengths, passes, seed):
    cu = cu_seqlens_from_lengths(lengths)
    diag, stair = ttt_mask(cu, passes, "diagonal"), ttt_mask(cu, passes, "staircase")
    rd, rs = ttt_row_map(cu, passes)
    # 1. the masks agree under the relabelling, and no common row sees a key outside the common rows
    assert torch.equal(diag[rd][:, rd], stair[rs][:, rs])
    assert torch.equal(diag[rd].sum(1), diag[rd][:, rd].sum(1))
    assert torch.equal(stair[rs].sum(1), stair[rs][:, rs].sum(1))
    # 2. hence the same attention: one K/V per (pass, sequence, anchor), laid out by each convention
    g = torch.Generator().manual_seed(seed)
    n, D = int(cu[-1]) * passes, 8
    q_lab, k_lab, v_lab = (torch.randn(n, 2, D, generator=g, dtype=torch.float64) for _ in range(3))
    outs = {}
    for conv, rows in (("diagonal", rd), ("staircase", rs)):
        lay = torch.zeros(n, dtype=torch.long)  # layout row -> label row (labels = diagonal rows)
        lay[rows] = rd
        q, k, v = q_lab[lay], k_lab[lay], v_lab[lay]
        m = ttt_mask(cu, passes, conv)
        s = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~m, float("-inf"))
        outs[conv] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)[rows]
    torch.testing.assert_close(outs["diagonal"], outs["staircase"], atol=1e-12, rtol=0)
    # 3. the staircase's phantom rows (anchor < 0) still see something: no empty row, no NaN
    assert bool(stair.any(1).all())


@settings(max_examples=10)
@given(lengths_st, st.integers(1, 4))
def test_ttt_diagonal_pass_d_is_the_branch_mask_with_P_equals_d_minus_1(lengths, passes):
    cu = cu_seqlens_from_lengths(lengths)
    T, m = int(cu[-1]), ttt_mask(cu, passes)
    for d in range(1, passes + 1):
        assert torch.equal(m[(d - 1) * T:d * T, :d * T], branch_attention_mask(cu, d - 1))
        assert not m[(d - 1) * T:d * T, d * T:].any()


def test_ring_attention_oracle_uses_the_branch_mask():  # P = 0: the trunk alone is packed causal attention
    cu = cu_seqlens_from_lengths([3, 4])
    q, k, v = (torch.randn(7, 2, 4, dtype=torch.float64) for _ in range(3))
    out, _ = reference_branch_attention(q, k, v, cu)
    s = torch.einsum("qhd,khd->hqk", q, k) / 2.0
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~causal_mask(cu), float("-inf")), -1), v)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(0, 3))
def test_tree_mask(raw, prefix):
    parents = [-1] + [p % (i + 1) - (1 if p % 5 == 0 else 0) for i, p in enumerate(raw[1:])]  # some extra roots
    m = tree_mask(parents, prefix_len=prefix)
    N = len(parents)
    assert m.shape == (N, prefix + N) and bool(m[:, :prefix].all())
    t = m[:, prefix:]
    for i in range(N):  # node i sees exactly its ancestor chain
        chain, j = set(), i
        while j >= 0:
            chain.add(j)
            j = parents[j]
        assert set(torch.nonzero(t[i]).flatten().tolist()) == chain
    assert torch.equal(tree_mask(list(range(-1, N - 1))), causal_mask(cu_seqlens_from_lengths([N])))  # chain = causal


def test_errors():
    with pytest.raises(ValueError, match="parents"):
        tree_mask([-1, 1])
    with pytest.raises(ValueError, match=r"pad_for_cp\(cu_seqlens, cp=2\)"):
        check_cp_padded(torch.tensor([0, 4, 6], dtype=torch.int32), 2)
    with pytest.raises(TypeError, match="cu_seqlens"):
        zigzag_index(torch.tensor([0.0, 4.0]), 1, 0)
    with pytest.raises(ValueError, match="rank"):
        zigzag_index(torch.tensor([0, 4], dtype=torch.int32), 2, 2)
    with pytest.raises(ValueError, match="x: expected 4 rows"):
        cp_shift(torch.zeros(3), torch.tensor([0, 4], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="convention"):
        ttt_labels(torch.tensor([0, 4], dtype=torch.int32), 2, "zigzag")
    with pytest.raises(ValueError, match="lengths"):
        cu_seqlens_from_lengths([3, -1])
