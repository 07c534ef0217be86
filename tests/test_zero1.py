"""parallel/zero1.py: the sharded optimizer steps exactly like the unsharded one (fp64, <= 1e-10), resumes from its
per-rank state, and refuses another layout. One process (no group) and 4 gloo ranks (a stage shared by dp 2 x cp 2;
N = 259 elements, not a multiple of 4, so the last slice is padded), and with the gradients reduce-scattered
(flat_grads) rather than all-reduced. DistCotrainer(zero1=True) against the single-process step is in
tests/test_dist_step.py and tests/test_config_matrix.py. Adds ~9 s in a full-suite run on 2 cores (one 4-process
spawn).
"""
import pytest
import torch
import torch.distributed as dist
from dist_util import run_distributed

from parallel.zero1 import ShardedOptimizer

SHAPES = [(7, 5), (3,), (11, 4, 2), (1,), (128,), (4,)]  # N = 35 + 3 + 88 + 1 + 128 + 4 = 259
STEPS = 3
TOL = 1e-10


def make_opt(params):
    return torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.99))


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in SHAPES]
    ps.append(torch.nn.Parameter(torch.randn(2, generator=g, dtype=torch.float64), requires_grad=False))  # frozen
    return ps


def grads_list(step, scale=1.0) -> list:  # the trained parameters' gradients of `step`, the same on every rank
    g = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(shape, generator=g, dtype=torch.float64) for shape in SHAPES]


def grads(ps, step):  # identical on every rank (as after PipelineSchedule's reduction)
    for p, g in zip(ps, grads_list(step) + [None]):  # the frozen one last: none
        p.grad = g if p.requires_grad else None


def reference(steps=STEPS, scale=1.0):
    ps = params()
    opt = make_opt([p for p in ps if p.requires_grad])
    for s in range(steps):
        for p, g in zip(ps, grads_list(s, scale)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in ps]


def run(group, steps=STEPS):
    ps = params()
    opt = ShardedOptimizer(ps, make_opt, group)
    for s in range(steps):
        opt.zero_grad()
        grads(ps, s)
        opt.step()
    return ps, opt


def max_diff(a, b):
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


def test_one_rank_equals_adamw():
    ps, _ = run(None)
    assert max_diff(ps, reference()) <= TOL


def test_rejects_mixed_dtypes_and_no_params():
    with pytest.raises(ValueError, match="params: expected one dtype"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).double())], make_opt)
    with pytest.raises(ValueError, match="params: expected at least one parameter"):
        ShardedOptimizer([], make_opt)


def test_a_parameter_without_gradient_is_an_error_not_a_silent_zero():
    ps = params()
    opt = ShardedOptimizer(ps, make_opt)
    grads(ps, 0)
    ps[1].grad = None
    with pytest.raises(ValueError, match=r"parameters \[1\] \(of 6\) have no gradient"):
        opt.step()


def test_unsharded_state_is_refused_by_name():
    ps = params()
    with pytest.raises(ValueError, match="state_dict: expected a ShardedOptimizer state"):
        ShardedOptimizer(ps, make_opt).load_state_dict(make_opt(ps[:1]).state_dict())


def _worker(rank, world):
    out = {}
    ps, opt = run(dist.group.WORLD)
    out["params"] = [p.detach().clone() for p in ps]
    out["state_numel"] = sum(v.numel() for st in opt.inner.state.values() for v in st.values() if v.dim())
    # resume: weights and this rank's state after 2 steps, then step 3 in a fresh optimizer
    ps2, opt2 = run(dist.group.WORLD, steps=STEPS - 1)
    saved_w, saved = [p.detach().clone() for p in ps2], opt2.state_dict()
    ps3 = params(seed=7)  # other starting weights: everything must come from the checkpoint
    opt3 = ShardedOptimizer(ps3, make_opt, dist.group.WORLD)
    with torch.no_grad():
        for p, w in zip(ps3, saved_w):
            p.copy_(w)
    opt3.load_state_dict(saved)
    grads(ps3, STEPS - 1)
    opt3.step()
    out["resumed"] = [p.detach().clone() for p in ps3]
    try:  # a state cut for another layout: 3 ranks instead of 4
        bad = dict(saved, layout=dict(saved["layout"], ranks=3))
        opt3.load_state_dict(bad)
        out["layout_error"] = None
    except ValueError as e:
        out["layout_error"] = str(e)
    out["scattered"] = reduce_scattered(rank)
    return out


def reduce_scattered(rank) -> tuple:
    """flat_grads: each rank's own gradient (rank r: (r + 1) g) reduce-scattered, /dp = 2, then stepped: the same
    weights as AdamW on the mean of the ranks' gradients over dp = 2 replicas of 2 summed shards (sum (r + 1) / 2 =
    5 g), with one reduce_scatter and no all-reduce. -> (max |difference|, the collectives issued)."""
    ps = params()
    opt = ShardedOptimizer(ps, make_opt, dist.group.WORLD, flat_grads=True)
    calls, wrapped = [], {}
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather"):
        wrapped[name] = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n) or wrapped[_n](*a, **k))
    try:
        for step in range(STEPS):
            for p, g in zip([p for p in ps if p.requires_grad], grads_list(step)):
                p.main_grad.copy_((rank + 1) * g)
            opt.reduce_scatter(dp=2)
            opt.step()
    finally:
        for name, fn in wrapped.items():
            setattr(dist, name, fn)
    ref = reference(scale=5.0)
    return max_diff(ps, ref), sorted(set(calls)), calls.count("reduce_scatter_tensor")


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_worker, 4, timeout=120)


def test_four_ranks_equal_adamw_and_hold_a_quarter_of_the_state(world4):
    ref = reference()
    n = sum(p.numel() for p in params() if p.requires_grad)
    for rank, out in enumerate(world4):
        assert max_diff(out["params"], ref) <= TOL, rank
        assert out["state_numel"] == 2 * -(-n // 4)  # m and v of one padded slice: ceil(N / 4) each


def test_resume_from_per_rank_state_continues_exactly(world4):
    ref = reference()
    for rank, out in enumerate(world4):
        assert max_diff(out["resumed"], ref) <= TOL, rank


def test_reduce_scattered_gradients_step_like_the_all_reduced_mean(world4):
    for rank, out in enumerate(world4):
        err, kinds, n = out["scattered"]
        assert err <= TOL and kinds == ["all_gather", "reduce_scatter_tensor"] and n == STEPS, (rank, out["scattered"])


def test_another_layout_is_refused(world4):
    for out in world4:
        assert out["layout_error"] and "sharded for 3 ranks" in out["layout_error"]
