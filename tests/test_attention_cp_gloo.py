"""The same per-rank code over real gloo processes (cp = 2, 3, 4) agrees with the in-process run (and the oracle).
One spawn per cp runs several cases; tests/dist_util.run_distributed fails (never hangs) after its timeout."""
import pytest
import torch

from branch_mask import cp_shift, shift_packed, zigzag_shard, zigzag_unshard
from dist_util import run_distributed
from attention_cases import assert_all_close, make_case, reference, run_threads, unshard_all


def _cases(cp):
    return [make_case([7, 1, 12], cp, 3, 2, 2, 16, seed=cp),  # GQA, P = 3, a sequence shorter than 2cp
            make_case([5, 9], cp, 0, 1, 3, 8, dtype=torch.float32, seed=10 + cp, backend="torch_tile5")]


def _gloo_worker(rank, world_size, cases, shift_case):
    import torch.distributed as dist

    from attention_cases import gloo_worker
    x, cu, d, lens = shift_case
    y, valid = cp_shift(zigzag_shard(x, cu, world_size, rank), cu, d, group=dist.group.WORLD, fill=-1.0,
                        lengths=lens)
    return gloo_worker(rank, world_size, cases), (y, valid)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gloo_matches_threads_and_dense(cp):
    cases = _cases(cp)
    cu_s = cases[0]["cu"]
    x = torch.randn(int(cu_s[-1]), 2, dtype=torch.float64)
    shift_case = (x, cu_s, 3, cases[0]["pad"].lengths)
    per_rank = run_distributed(_gloo_worker, cp, args=(cases, shift_case), timeout=90)
    for i, case in enumerate(cases):
        got = unshard_all([r[0][i] for r in per_rank], case["cu"])
        tol = 1e-12 if case["q"].dtype == torch.float64 else 1e-6
        assert_all_close(got, run_threads(case), atol=tol, rtol=tol)
        tol = 1e-10 if case["q"].dtype == torch.float64 else 1e-5
        assert_all_close(got, reference(case), atol=tol, rtol=tol)
    y = zigzag_unshard([r[1][0] for r in per_rank], cu_s)
    want, valid = shift_packed(x, cu_s, 3, fill=-1.0, lengths=shift_case[3])
    assert torch.equal(y, want) and torch.equal(zigzag_unshard([r[1][1] for r in per_rank], cu_s), valid)
