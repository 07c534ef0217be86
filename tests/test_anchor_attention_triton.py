"""anchor_branch_attention(..., backend="triton") against the dense fp64 oracle: the kernels' per-row key ends
(causal kind 2: the queries of anchors see the trunk up to their anchor), in-process ring at cp 1 and 2, forward and
backward, both anchor conventions, W > 1 as extra query heads, P = 0 and P > 0, a rank without anchors.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before attention_triton is imported), so
shapes are small and tiles are 16 rows (several tiles, partial ones, a binary search over the ends). About 12 s here
(27 s with the first import of triton). On CUDA the DFlash block case runs at the 8B draft's shape: head_dim 128,
GQA 4, blocks of 5, bf16.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' on Linux x86_64)")

from backends import attention_triton  # noqa: E402  (after TRITON_INTERPRET)
from attention_cp import reference_anchor_attention, register_backend  # noqa: E402
from attention_blocks import KeyEnds, Segment  # noqa: E402
from backends.attention_triton import TritonBlocks, tile_table  # noqa: E402
from anchor_cases import NAMES, _loss, assert_all_close, make_case, reference, run_threads  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not attention_triton.INTERPRETED:
    pytest.skip("attention_triton was imported before TRITON_INTERPRET=1 was set, and there is no GPU",
                allow_module_level=True)
# a query that sees no key ends with l = 0, lse = ln 2 * log2(0) = -inf by design; numpy (the interpreter) warns
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
register_backend("triton_anchor16", TritonBlocks(fwd_tiles=(16, 16), bwd_tiles=(16, 16), branch_rows=16))


@pytest.mark.parametrize("cp,W,P,visible,pick", [(1, 2, 2, False, "random"), (2, 3, 0, True, "edges"),
                                                 (2, 1, 1, False, "first_row")])
def test_ring_matches_dense_fp64(cp, W, P, visible, pick):
    case = make_case([29, 6, 40], cp, W, P, Hkv=2, G=1, D=16, visible=visible, pick=pick, dtype=torch.float32,
                     seed=cp + W, backend="triton_anchor16")
    got = run_threads(case, DEVICE)
    assert got["out"].dtype == torch.float32
    assert_all_close(got, reference(case), atol=3e-5, rtol=3e-5)


def dense(case, dtype, device):
    """The dense masked oracle (reference_anchor_attention) in `dtype` on `device`: what plain PyTorch gives."""
    ins = [None if case[n] is None else case[n].to(device, dtype).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
    out, lse = reference_anchor_attention(ins[0], ins[1], ins[2], case["cu"], case["anchors"].to(device), ins[3],
                                          ins[4], anchor_visible=case["visible"])
    _loss(out, lse, case["dout"].to(device, dtype), case["dlse"].to(device, dtype)).backward()
    return dict(zip(NAMES, [t.detach().double().cpu() for t in [out, lse] + [x.grad for x in ins]]))


@pytest.mark.parametrize("cp", [1, 2])
def test_gqa4_block5_matches_fp64(cp):
    """DFlash blocks as the 8B draft runs them: GQA 4 (Hq = 4 Hkv), W = 5 slots per anchor, each slot seeing the
    block's 5 entries (P = 5) and the trunk before its anchor. CUDA: head_dim 128, bf16, the default tiles, sequences
    of many tiles; per tensor max |ours - fp64| <= 2 max |dense bf16 - fp64| + 1e-3 (tests/test_attention_gpu.py's bar).
    CPU: the interpreter has no bf16 dot (tests/test_attention_triton.py), so head_dim 16, fp32, 16-row tiles."""
    if DEVICE == "cpu":
        case = make_case([29, 6, 40], cp, W=5, P=5, Hkv=1, G=4, D=16, visible=False, dtype=torch.float32, seed=11,
                         backend="triton_anchor16")
        assert_all_close(run_threads(case, DEVICE), reference(case), atol=3e-5, rtol=3e-5)
        return
    case = make_case([600, 333, 1100], cp, W=5, P=5, Hkv=2, G=4, D=128, visible=False, dtype=torch.bfloat16,
                     seed=11, backend="triton")
    got, exact, dense16 = run_threads(case, DEVICE), reference(case), dense(case, torch.bfloat16, DEVICE)
    assert got["out"].dtype == torch.bfloat16
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(exact["lse"])), "lse: -inf rows differ"
    for n in NAMES:
        a, b, c = (torch.where(torch.isinf(exact[n]), 0, x[n].double()) for x in (got, exact, dense16))
        err, bar = (a - b).abs().max().item(), 2 * (c - b).abs().max().item() + 1e-3
        assert err <= bar, f"cp={cp} {n}: max error {err:.3e} > 2 x dense bf16 error + 1e-3 = {bar:.3e}"


def test_tile_table_orders_by_the_rows_ends():
    """Kind 2 for causal segments given ends; the work estimate follows the ends (longest first)."""
    ends = KeyEnds((1, 2, 30, 31, 40), torch.tensor([1, 2, 30, 31, 40]))
    segs = [Segment(0, 5, 0, 40, True)]
    q = tile_table(segs, "q", 2, "cpu", ends).long()
    assert q[:, 5].tolist() == [2, 2, 2] and q[:, :2].tolist() == [[4, 5], [2, 4], [0, 2]]
    k = tile_table(segs, "k", 16, "cpu", ends).long()  # key tile [32, 40) is seen by the last query only
    assert k[:, :2].tolist() == [[0, 16], [16, 32], [32, 40]]
