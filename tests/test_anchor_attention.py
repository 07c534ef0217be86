"""attention_cp.anchor_branch_attention (W queries per anchor over the zigzag ring + each anchor's P branch entries)
against the dense fp64 oracle, run as real per-rank code over an in-process ring (threads): out, lse and the grads of
q, k, v, branch_k, branch_v, both anchor conventions (j <= a: TTT; j < a: DFlash blocks), at cp 1..4. Also: TTT as its
special case equals ring_branch_attention, shard_anchors, the loud errors, and peak memory with no (N W, T) tensor.
About 18 s on this machine (2 cores shared with other jobs)."""
import contextlib

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from attention_blocks import KeyEnds, Segment, TorchBlocks
from attention_cp import anchor_branch_attention, register_backend, ring_branch_attention
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, shard_anchors, zigzag_index, zigzag_shard
from harness.memory_track import StorageTracker
from parallel.ring import run_ranks
from anchor_cases import PICKS, assert_all_close, make_case, reference, run_threads
from sync_count import HostSyncs

for _t in (3, 5):  # tiny tiles: partial, skipped and masked tiles on small shapes
    register_backend(f"torch_tile{_t}", TorchBlocks(tile=_t))

cases = st.fixed_dictionaries(dict(
    lengths=st.lists(st.integers(1, 13), min_size=1, max_size=4), cp=st.integers(1, 4), W=st.integers(1, 3),
    P=st.integers(0, 3), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2]), D=st.sampled_from([4, 8]),
    visible=st.booleans(), pick=st.sampled_from(PICKS), seed=st.integers(0, 2**16),
    backend=st.sampled_from(["torch_tile3", "torch_tile5", "torch"])))


@settings(max_examples=40, deadline=None)
@given(cases)
@example(dict(lengths=[1, 13, 2, 7], cp=4, W=3, P=2, Hkv=2, G=2, D=8, visible=False, pick="edges", seed=1,
              backend="torch_tile3"))  # every chunk edge, blocks that see nothing of the trunk at a sequence's start
@example(dict(lengths=[9, 4], cp=3, W=2, P=0, Hkv=1, G=2, D=4, visible=False, pick="first_row", seed=2,
              backend="torch_tile5"))  # no branch, one query that sees no key, ranks 1-2 with no anchor
@example(dict(lengths=[12], cp=2, W=1, P=1, Hkv=1, G=1, D=4, visible=True, pick="none", seed=3,
              backend="torch"))  # no anchor anywhere: the ring still runs, trunk grads are zero
@example(dict(lengths=[13, 6], cp=2, W=2, P=3, Hkv=2, G=1, D=8, visible=True, pick="all", seed=4,
              backend="torch_tile3"))  # every row an anchor (TTT's layout) with W > 1
@example(dict(lengths=[11, 7], cp=2, W=5, P=2, Hkv=1, G=2, D=4, visible=False, pick="random", seed=5,
              backend="torch_tile3"))  # W G = 10 query heads per kv head: query tiles of 2 anchors, not 3
def test_fp64_matches_dense(c):
    case = make_case(**c)
    assert_all_close(run_threads(case), reference(case), atol=1e-10, rtol=1e-10)


@settings(max_examples=6, deadline=None)
@given(cases)
def test_fp32_matches_dense_fp64(c):
    case = make_case(dtype=torch.float32, **c)
    got = run_threads(case)
    assert got["out"].dtype == torch.float32 and got["lse"].dtype == torch.float32
    assert_all_close(got, reference(case), atol=1e-5, rtol=1e-5)


def test_sees_nothing_gives_zero_out_minus_inf_lse_zero_grads():
    case = make_case([6, 4], 1, W=2, P=0, Hkv=1, G=1, D=4, visible=False, pick="first_row", backend="torch")
    got = run_threads(case)
    assert torch.equal(got["out"], torch.zeros_like(got["out"])) and bool(torch.isneginf(got["lse"]).all())
    for n in ("dq", "dk", "dv"):
        assert torch.equal(got[n], torch.zeros_like(got[n])), n


@pytest.mark.parametrize("cp,P,backend", [(1, 0, "torch"), (2, 2, "torch_tile3"), (3, 1, "torch_tile5"),
                                          (4, 3, "torch")])
def test_ttt_is_the_special_case(cp, P, backend):
    """anchors = every local row, W = 1, anchor visible: exactly ring_branch_attention (the policy's / TTT's call)."""
    case = make_case([13, 5, 20], cp, W=1, P=P, Hkv=2, G=2, D=8, visible=True, pick="all", backend=backend)
    cu = case["cu"]

    def rank(ring):
        idx = zigzag_index(cu, cp, ring.rank)
        shard = lambda x: None if x is None else x[idx]  # noqa: E731  (anchors = all rows: per-anchor = per-row)
        outs = []
        for general in (True, False):
            ins = [None if case[n] is None else shard(case[n]).clone().requires_grad_() for n in
                   ("q", "k", "v", "bk", "bv")]
            q = ins[0] if general else ins[0][:, 0]  # (N, W=1, Hq, D) vs (T, Hq, D)
            kw = dict(group=ring, return_lse=True, backend=backend)
            out, lse = (anchor_branch_attention(q, ins[1], ins[2], cu, torch.arange(len(idx)), ins[3], ins[4], **kw)
                        if general else ring_branch_attention(q, ins[1], ins[2], cu, ins[3], ins[4], **kw))
            out, lse = out.reshape(len(idx), -1, out.shape[-1]), lse.reshape(len(idx), -1)
            ((out * shard(case["dout"])[:, 0]).sum() + (lse * shard(case["dlse"])[:, 0]).sum()).backward()
            outs.append([out.detach(), lse.detach()] + [None if x is None else x.grad for x in ins])
        return outs

    for general, ttt in run_ranks(cp, rank, timeout=60):
        for a, b in zip(general, ttt):
            assert (a is None and b is None) or torch.equal(a, b)  # bit for bit: the same tiles, masks and merges


def test_tiles_stop_at_the_rows_key_ends():
    """Per-row key ends (non-decreasing): a query tile stops at its last row's end and is masked past its first's."""
    ends = KeyEnds((1, 2, 30, 31, 40), torch.tensor([1, 2, 30, 31, 40]))
    tiles = list(TorchBlocks(tile=4)._tiles(Segment(0, 5, 0, 40, True), ends))
    first = [(k.start, masked) for q, k, masked in tiles if q.start == 0]
    assert first == [(k, True) for k in range(0, 32, 4)]  # rows 0-3 end at 31 at most: 8 of 10 key tiles
    assert [masked for q, k, masked in tiles if q.start == 4] == [False] * 10  # row 4 sees all 40 keys


def test_no_host_reads_after_the_first_call_on_an_anchors_tensor():
    """The anchors are read to the host once per tensor (host_cu's cached copy); a second layer's forward + backward
    on the same tensors reads nothing back (tests/test_host_sync.py counts the same for ring_branch_attention)."""
    case = make_case([13, 5, 20], 2, W=2, P=2, Hkv=2, G=2, D=8, visible=False, backend="torch_tile5")
    found = []

    def rank(ring):
        local, index = shard_anchors(case["anchors"], case["cu"], 2, ring.rank)
        trunk = lambda x: zigzag_shard(x, case["cu"], 2, ring.rank)  # noqa: E731
        ins = [case["q"][index], trunk(case["k"]), trunk(case["v"]), case["bk"][index], case["bv"][index]]
        ins = [x.requires_grad_() for x in ins]
        dout = case["dout"][index]
        for layer in range(2):  # the first layer makes the host copies of cu_seqlens and of the local anchors
            with HostSyncs() if layer else contextlib.nullcontext() as syncs:
                out = anchor_branch_attention(*ins[:3], case["cu"], local, *ins[3:], anchor_visible=False, group=ring,
                                              backend=case["backend"])
                (out * dout).sum().backward()
        found.extend(syncs.sites)

    run_ranks(2, rank, timeout=60)
    assert found == [], found


def test_shard_anchors_round_trip():
    cu = pad_for_cp(cu_seqlens_from_lengths([7, 16, 3]), 3).cu_seqlens
    rows = torch.tensor([0, 1, 5, 6, 6, 11, 12, 17, 23, 29, 30, 35])  # padded lengths 12, 18, 6
    seen = torch.zeros(len(rows), dtype=torch.long)
    for r in range(3):
        local, index = shard_anchors(rows, cu, 3, r)
        assert torch.equal(zigzag_index(cu, 3, r)[local], rows[index])  # the local row holds that global row
        assert bool((local[1:] >= local[:-1]).all())
        seen[index] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    with pytest.raises(ValueError, match="anchor_rows"):
        shard_anchors(torch.tensor([3, 2]), cu, 3, 0)
    with pytest.raises(ValueError, match="anchor_rows"):
        shard_anchors(torch.tensor([int(cu[-1])]), cu, 3, 0)


def test_loud_on_bad_inputs():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q, k = torch.randn(2, 3, 2, 4), torch.randn(8, 1, 4)
    good = torch.tensor([1, 5])
    for bad, err, match in [(torch.tensor([5, 1]), ValueError, "non-decreasing"),
                            (torch.tensor([1, 8]), ValueError, r"\[0, T_local=8\)"),
                            (torch.tensor([1, 5], dtype=torch.int32), TypeError, "anchors: expected an int64"),
                            (torch.tensor([1]), ValueError, r"anchors: expected \(N=2,\)")]:
        with pytest.raises(err, match=match):
            anchor_branch_attention(q, k, k, cu, bad)
    with pytest.raises(ValueError, match=r"q: expected \(N anchors, W, Hq, D\)"):
        anchor_branch_attention(q[:, 0], k, k, cu, good)
    with pytest.raises(ValueError, match=r"branch_k: expected \(N=2, P, Hkv=1, D=4\)"):
        anchor_branch_attention(q, k, k, cu, good, torch.randn(8, 2, 1, 4), torch.randn(8, 2, 1, 4))

    class NoLimits:  # a kernel without per-row key limits (as the flash-attn backend)
        pass
    register_backend("no_limits_test", NoLimits())
    with pytest.raises(ValueError, match="backend='no_limits_test' has no per-anchor key limits"):
        anchor_branch_attention(q, k, k, cu, good, backend="no_limits_test")


def test_memory_is_linear_no_query_by_trunk_tensor():
    """Forward + backward at T = 16384 (two sequences), N = 1024 anchors, W = 4 (cp = 1, default tile 256): the
    transient peak stays below N W T bytes, one bool mask of the queries over the trunk (their fp64 scores would be 8x
    that per head). The anchors are each sequence's first 512 rows, so the test computes little while any tensor
    over (queries, trunk) would still be that large. Measured: about 15 MiB against the 64 MiB bound (tiles of 256
    anchors x W G query heads x 256 keys, and the inputs' gradients)."""
    T, N, W, Hkv, G, D = 16384, 1024, 4, 1, 2, 16
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    anchors = torch.cat([torch.arange(N // 2), T // 2 + torch.arange(N // 2)])
    q = torch.randn(N, W, Hkv * G, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(T, Hkv, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bk, bv = (torch.randn(N, W, Hkv, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with StorageTracker() as tr:
        out = anchor_branch_attention(q, k, v, cu, anchors, bk, bv, anchor_visible=False)
        out.square().sum().backward()
        del out
    assert 0 < tr.peak() < N * W * T, f"peak {tr.peak() / 2**20:.1f} MiB"
