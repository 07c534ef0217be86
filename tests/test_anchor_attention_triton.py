"""anchor_branch_attention(..., backend="triton") against the dense fp64 oracle: the kernels' per-row key ends
(causal kind 2: the queries of anchors see the trunk up to their anchor), in-process ring at cp 1 and 2, forward and
backward, both anchor conventions, W > 1 as extra query heads, P = 0 and P > 0, a rank without anchors.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before attention_triton is imported), so
shapes are small and tiles are 16 rows (several tiles, partial ones, a binary search over the ends). About 12 s here
(27 s with the first import of triton).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' on Linux x86_64)")

from backends import attention_triton  # noqa: E402  (after TRITON_INTERPRET)
from attention_cp import register_backend  # noqa: E402
from attention_blocks import KeyEnds, Segment  # noqa: E402
from backends.attention_triton import TritonBlocks, tile_table  # noqa: E402
from anchor_cases import assert_all_close, make_case, reference, run_threads  # noqa: E402

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


def test_tile_table_orders_by_the_rows_ends():
    """Kind 2 for causal segments given ends; the work estimate follows the ends (longest first)."""
    ends = KeyEnds((1, 2, 30, 31, 40), torch.tensor([1, 2, 30, 31, 40]))
    segs = [Segment(0, 5, 0, 40, True)]
    q = tile_table(segs, "q", 2, "cpu", ends).long()
    assert q[:, 5].tolist() == [2, 2, 2] and q[:, :2].tolist() == [[4, 5], [2, 4], [0, 2]]
    k = tile_table(segs, "k", 16, "cpu", ends).long()  # key tile [32, 40) is seen by the last query only
    assert k[:, :2].tolist() == [[0, 16], [16, 32], [32, 40]]
