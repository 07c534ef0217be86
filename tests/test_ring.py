"""ring.run_ranks and grid.py without processes: each rank's autograd runs on its own thread (the CUDA backward hang),
and the grid's groups and warm-up plan are one global order that every rank agrees on."""
import torch

from parallel.grid import mesh_groups, warm_up_plan
from parallel.ring import run_ranks


def test_run_ranks_turns_autograd_multithreading_off_per_rank():
    """On CUDA, autograd's backward runs on one worker thread per device shared by all callers; rank 0 blocking there
    on rank 1 would hang rank 1's backward behind it. Each rank's call must run with multithreading off."""
    assert torch.autograd.is_multithreading_enabled()
    assert run_ranks(3, lambda ring: torch.autograd.is_multithreading_enabled()) == [False, False, False]
    assert torch.autograd.is_multithreading_enabled()  # restored in the caller


def test_run_ranks_backward_exchanges_on_every_rank():
    """A backward that exchanges with the other rank (as ring attention's does) completes on both."""
    class Swap(torch.autograd.Function):  # y = the other rank's x; dy goes back to the other rank
        @staticmethod
        def forward(ctx, x, ring):
            ctx.ring = ring
            buf = torch.empty_like(x)
            ring.exchange([(1 - ring.rank, x)], [(1 - ring.rank, buf)]).wait()
            return buf

        @staticmethod
        def backward(ctx, dy):
            buf = torch.empty_like(dy)
            ctx.ring.exchange([(1 - ctx.ring.rank, dy)], [(1 - ctx.ring.rank, buf)]).wait()
            return buf, None

    def rank(ring):
        x = torch.full((3,), float(ring.rank + 1), requires_grad=True)
        (Swap.apply(x, ring) * (ring.rank + 10)).sum().backward()
        return x.grad.tolist()

    assert run_ranks(2, rank, timeout=30) == [[11.0] * 3, [10.0] * 3]


def test_mesh_groups_and_warm_up_plan():
    groups = mesh_groups(pp=2, cp=2, dp=2)  # rank = (d * pp + s) * cp + c
    assert [g for g in groups if g[0] == "pp"] == [("pp", [0, 2]), ("pp", [1, 3]), ("pp", [4, 6]), ("pp", [5, 7])]
    assert [g for g in groups if g[0] == "cp"] == [("cp", [0, 1]), ("cp", [2, 3]), ("cp", [4, 5]), ("cp", [6, 7])]
    assert [g for g in groups if g[0] == "dp"] == [("dp", [0, 4]), ("dp", [1, 5]), ("dp", [2, 6]), ("dp", [3, 7])]
    assert [g for g in groups if g[0] == "embed"] == [("embed", r) for _, r in groups if _ == "pp"]
    plan = warm_up_plan(pp=3, cp=1, dp=1)
    assert plan[0] == ("coll", "world", [0, 1, 2])
    assert [p for p in plan if p[0] == "link"] == [("link", "tap", (0, 2)), ("link", "tap", (1, 2))]
    assert warm_up_plan(1, 1, 1) == [] and mesh_groups(1, 1, 1) == []
