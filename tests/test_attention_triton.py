"""attention_triton.TritonBlocks against the PyTorch block kernel (TorchBlocks in fp64) block by block, and
ring_branch_attention(..., backend="triton") end to end against dense fp64 at cp = 1 and 2 (in-process ring).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before attention_triton is
imported: triton.jit decides at decoration time), which is slow, so shapes are small and tiles are 16 rows to still
cover several tiles, partial tiles and the causal diagonal. With CUDA the same tests run the compiled kernels.
The interpreter computes bf16 dots on raw bit patterns (triton-lang/triton#11584), so bf16 is tested on CUDA only
(tests/test_attention_gpu.py); fp16 covers the low-precision casts here.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' on Linux x86_64)")

from backends import attention_triton  # noqa: E402  (after TRITON_INTERPRET)
from attention_cp import Segment, TorchBlocks, register_backend  # noqa: E402
from attention_cp import ring_branch_attention  # noqa: E402
from backends.attention_triton import TritonBlocks, tile_table  # noqa: E402
from branch_mask import zigzag_shard  # noqa: E402
from parallel.ring import run_ranks  # noqa: E402
from attention_cases import assert_all_close, make_case, reference, unshard_all  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not attention_triton.INTERPRETED:
    pytest.skip("attention_triton was imported before TRITON_INTERPRET=1 was set, and there is no GPU",
                allow_module_level=True)

KERNEL = TritonBlocks(fwd_tiles=(16, 16), bwd_tiles=(32, 16), branch_rows=16)  # small: more tiles per case
register_backend("triton_t16", KERNEL)
F64 = torch.float64
SCALE = 0.3

# (name, T, segments): the three block shapes of the zigzag ring over a packed batch of two sequences
# (lengths 12 and 24, local chunks C = 6 and 12), and hand-made lists the ring never sends but the protocol allows.
CASES = [
    ("step0_causal", 36, [Segment(0, 12, 0, 12, True), Segment(12, 36, 12, 36, True)]),
    ("src_before_me_full", 36, [Segment(0, 12, 0, 6, False), Segment(12, 36, 12, 24, False)]),
    ("src_after_me_half", 36, [Segment(6, 12, 0, 12, False), Segment(24, 36, 12, 36, False)]),
    ("nonsquare_causal_overlapping", 36, [Segment(0, 30, 3, 12, True), Segment(4, 14, 0, 36, True),
                                          Segment(20, 36, 0, 5, False)]),
]


def _inputs(T, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, k, v = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    return [x.to(dtype).to(DEVICE) for x in (q, k, v)]


def _forward(kernel, q, k, v, segments, acc, start=None):
    out = torch.zeros(q.shape, dtype=acc, device=q.device) if start is None else start[0].to(acc).clone()
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device) if start is None else \
        start[1].to(acc).clone()
    kernel.forward(q, k, v, segments, SCALE, out, lse)
    return out, lse


@pytest.mark.parametrize("name,T,segments", CASES, ids=[c[0] for c in CASES])
def test_forward_merges_like_torch_blocks(name, T, segments):
    """Starts from a non-empty partial result (the kernel merges in place), GQA G = 2, D = 24 (masked lanes)."""
    q, k, v = _inputs(T, 4, 2, 24, torch.float32, seed=len(name))
    ref = TorchBlocks(tile=7)
    first = [Segment(0, T, 0, 4, False)]  # an earlier "ring step" every row has seen
    start = _forward(ref, q.double(), k.double(), v.double(), first, F64)
    want = _forward(ref, q.double(), k.double(), v.double(), segments, F64, start)
    got = _forward(KERNEL, q, k, v, segments, torch.float32, start)
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1].double(), want[1], atol=2e-5, rtol=2e-5)


def test_forward_rows_no_segment_touches_keep_their_partial():
    q, k, v = _inputs(36, 2, 1, 16, torch.float32, seed=3)
    out = torch.randn(36, 2, 16, device=DEVICE)
    lse = torch.randn(36, 2, device=DEVICE)
    out0, lse0 = out.clone(), lse.clone()
    KERNEL.forward(q, k, v, [Segment(8, 20, 8, 20, True)], SCALE, out, lse)
    untouched = torch.cat([torch.arange(0, 8), torch.arange(20, 36)])
    assert torch.equal(out[untouched], out0[untouched]) and torch.equal(lse[untouched], lse0[untouched])
    assert not torch.equal(out[8:20], out0[8:20])


@pytest.mark.parametrize("name,T,segments", CASES, ids=[c[0] for c in CASES])
def test_backward_adds_like_torch_blocks(name, T, segments):
    """dq, dk, dv start non-zero (the kernel adds); lse is a real one (this block plus an earlier block)."""
    Hq, Hkv, D = 4, 2, 24
    q, k, v = _inputs(T, Hq, Hkv, D, torch.float32, seed=10 + len(name))
    g = torch.Generator().manual_seed(1)
    dout, delta = torch.randn(T, Hq, D, generator=g).to(DEVICE), torch.randn(T, Hq, generator=g).to(DEVICE)
    ref = TorchBlocks(tile=7)
    start = _forward(ref, q.double(), k.double(), v.double(), [Segment(0, T, 0, 4, False)], F64)
    _, lse = _forward(ref, q.double(), k.double(), v.double(), segments, F64, start)
    grads0 = [torch.randn(T, Hq, D, generator=g), torch.randn(T, Hkv, D, generator=g),
              torch.randn(T, Hkv, D, generator=g)]
    want = [x.double().to(DEVICE) for x in grads0]
    ref.backward(q.double(), k.double(), v.double(), dout.double(), lse, delta.double(), segments, SCALE, *want)
    got = [x.to(DEVICE) for x in grads0]
    KERNEL.backward(q, k, v, dout, lse.float(), delta, segments, SCALE, *got)
    for n, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("P,G", [(1, 1), (3, 2)])
def test_branch_forward_and_backward_match_torch_blocks(P, G):
    T, Hkv, D = 21, 2, 12  # T not a multiple of the 16-row tile, D not a power of 2
    g = torch.Generator().manual_seed(P)
    q, bk, bv = (torch.randn(*s, generator=g).to(DEVICE) for s in ((T, Hkv * G, D), (T, P, Hkv, D), (T, P, Hkv, D)))
    dout, delta = torch.randn(T, Hkv * G, D, generator=g).to(DEVICE), torch.randn(T, Hkv * G, generator=g).to(DEVICE)
    ref = TorchBlocks(tile=4)
    want_out, want_lse = ref.branch_forward(q.double(), bk.double(), bv.double(), SCALE, F64)
    got_out, got_lse = KERNEL.branch_forward(q, bk, bv, SCALE, torch.float32)
    torch.testing.assert_close(got_out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    lse = want_lse + 0.5  # any lse: the backward takes it as given (the final one in the ring)
    dq0 = torch.randn(T, Hkv * G, D, generator=g).to(DEVICE)
    want_dq, got_dq = dq0.double().clone(), dq0.clone()
    want = ref.branch_backward(q.double(), bk.double(), bv.double(), dout.double(), lse, delta.double(), SCALE, want_dq)
    got = KERNEL.branch_backward(q, bk, bv, dout, lse.float(), delta, SCALE, got_dq)
    for n, a, b in zip(("dq", "dbk", "dbv"), (got_dq,) + got, (want_dq,) + want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=lambda m: f"{n}: {m}")


def test_tile_table_covers_every_row_once_longest_first():
    segs = [Segment(0, 40, 0, 40, True), Segment(40, 50, 40, 60, False), Segment(90, 90, 90, 95, False)]
    for side, rows in (("q", 16), ("k", 32)):
        t = tile_table(segs, side, rows, "cpu").long()
        assert t.shape[1] == 6 and bool((t[:, 1] - t[:, 0] <= rows).all()) and bool((t[:, 1] > t[:, 0]).all())
        covered = torch.cat([torch.arange(s, e) for s, e in t[:, :2].tolist()]).sort().values
        spans = [(s.q0, s.q1) if side == "q" else (s.k0, s.k1) for s in segs]
        assert covered.tolist() == [i for a, b in spans for i in range(a, b)]
    q = tile_table(segs, "q", 16, "cpu").long()  # causal tile [32, 40) sees 40 keys: first; [0, 16) sees 16
    assert q[0].tolist() == [32, 40, 0, 0, 40, 1] and q[:, 1].tolist()[-1] == 16


def _run_ring(case):
    """attention_cases.run_threads, with each rank's shards moved to DEVICE (the sharding itself runs on the host)."""
    def rank(ring):
        shard = lambda x: None if x is None else zigzag_shard(x, case["cu"], case["cp"], ring.rank).to(DEVICE)  # noqa
        ins = [None if case[n] is None else shard(case[n]).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
        out, lse = ring_branch_attention(*ins[:3], case["cu"], *ins[3:], group=ring, return_lse=True,
                                         backend=case["backend"])
        ((out * shard(case["dout"])).sum() + (lse * shard(case["dlse"])).sum()).backward()
        return [x.detach().cpu() for x in (out, lse)] + [None if x is None else x.grad.cpu() for x in ins]
    return unshard_all(run_ranks(case["cp"], rank, timeout=120), case["cu"])


@pytest.mark.parametrize("cp,backend", [(1, "triton_t16"), (2, "triton_t16"), (1, "triton")])
def test_ring_end_to_end_matches_dense_fp64(cp, backend):
    """ring_branch_attention(..., backend=...): out, lse and the grads of q, k, v, branch_k, branch_v, with a loss on
    lse too (dlse enters delta), GQA G = 2, P = 2, three packed sequences padded for cp. "triton" is the registered
    default (its own tile sizes: one partial tile per sequence here)."""
    case = make_case([13, 5, 20], cp, P=2, Hkv=2, G=2, D=16, dtype=torch.float32, seed=cp, backend=backend)
    got = _run_ring(case)
    assert got["out"].dtype == torch.float32 and got["dbk"].dtype == torch.float32
    assert_all_close(got, reference(case), atol=2e-5, rtol=2e-5)


def test_fp16_inputs_end_to_end():
    case = make_case([11, 6], 2, P=1, Hkv=1, G=2, D=16, dtype=torch.float16, seed=5, backend="triton_t16")
    got, want = _run_ring(case), reference(case)
    assert got["out"].dtype == torch.float16 and got["dq"].dtype == torch.float16
    for n in ("out", "lse", "dq", "dk", "dv", "dbk", "dbv"):  # fp16 rounding of inputs, p and outputs only
        torch.testing.assert_close(got[n].double(), want[n], atol=1e-2, rtol=1e-2, msg=lambda m: f"{n}: {m}")


def test_loud_on_inputs_it_cannot_take():
    q, k, v = _inputs(8, 2, 1, 16, torch.float32, seed=0)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match='backend="triton".*fp64'):
        ring_branch_attention(q.double(), k.double(), v.double(), cu, backend="triton_t16")
    out, lse = torch.zeros(8, 2, 16, dtype=F64, device=DEVICE), torch.zeros(8, 2, dtype=F64, device=DEVICE)
    with pytest.raises(TypeError, match="accumulators must be fp32"):
        KERNEL.forward(q, k, v, [Segment(0, 8, 0, 8, True)], SCALE, out, lse)
    if attention_triton.INTERPRETED:
        with pytest.raises(TypeError, match="11584"):
            KERNEL.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), [Segment(0, 8, 0, 8, True)], SCALE,
                           out.float(), lse.float())


def test_tile_sizes_are_validated_and_defaults_follow_the_head_dim():
    for kw in (dict(fwd_tiles=(8, 16)), dict(bwd_tiles=(32, 24)), dict(dkdv_tiles=(16, 15)), dict(branch_rows=8)):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name}=.*power of two >= 16"):
            TritonBlocks(**kw)
    cfg = lambda D, dtype=torch.bfloat16: TritonBlocks().config(torch.empty(1, 1, D, dtype=dtype))  # noqa: E731
    assert cfg(64)["dkdv"][0] == (64, 64) and cfg(64)["branch"] == (32, {"num_warps": 8})
    assert cfg(128)["dkdv"] == ((32, 16), {"num_warps": 8, "num_stages": 2})  # 128x32 spilled 2 KB at D = 128
    assert cfg(128)["branch"] == (16, {"num_warps": 8}) and cfg(256)["branch"] == (16, {"num_warps": 8})
    assert cfg(256)["fwd"][0] == (32, 16) and cfg(128, torch.float32)["fwd"][0] == (32, 16)
    kernels = lambda c: {k: c[k] for k in ("fwd", "dq", "dkdv", "branch")}  # noqa: E731
    assert kernels(cfg(64, torch.float32)) == kernels(cfg(128))  # by bytes per row
    assert KERNEL.config(torch.empty(1, 1, 16))["dkdv"][0] == (32, 16)  # bwd_tiles covers dK/dV unless overridden
