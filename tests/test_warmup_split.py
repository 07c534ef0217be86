"""The warm-ups split over ranks (harness/warmup_split.py) equal the one-process warm-ups.

Two gloo processes run the SFT warm-up and the draft warm-up (sampling spread by blocks, training data parallel with a
gradient sum) on a tiny policy; this process runs the same specs alone. In fp64 the weights agree to 1e-9 (only the
order of the gradient additions differs); in bf16 (fp32 masters) both ranks hold identical weights and the split
run moves within 10% of the one-process update (the packing of a rank's sequences rounds differently). Rank 0
alone writes the cache entry; a second call on every rank loads it. Then experiment.build_models, as the ranks of a
GPU mesh call it, on 2 gloo ranks: identical weights, one cache entry each under the one-process keys. Adds ~80 s on
2 cores (two gloo jobs of two processes importing torch, the warm-ups at tiny size).
"""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_distributed
from harness import experiment, warmup
from harness.config import parse_args
from harness.mesh import Mesh
from parallel.grid import Grid
from harness.cache_keys import DraftSpec, PolicySpec
from harness.warmup_split import MasterOptimizer, gather_blocks, micro_count
from model import ModelConfig, Transformer
from tasks import task

LIMIT_S = 300


def specs(dtype: str):
    """An SFT spec whose batch (5) does not split evenly over 2 ranks, and a draft spec with blocks of 3 prompts
    (3, 3, 2: rank 0 samples two blocks, rank 1 one) and 4 micro-batches per step."""
    tsk = task.CountUpTask(1, 2)
    model = ModelConfig.preset("tiny", vocab_size=tsk.tok.vocab_size)
    ps = PolicySpec(model, tsk, steps=3, batch=5, lr=1e-2, seed=0, dtype=dtype)
    ds = DraftSpec("p", tsk, steps=3, batch=4, lr=3e-3, pool=8, max_new_tokens=6, num_passes=2, seed=0,
                   draft_vocab=6, rows=3, dtype=dtype)
    return ps, ds


def state(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items() if "embed" not in k or "model." in k}


def seeded_policy(dtype: str) -> Transformer:
    torch.manual_seed(1)
    return Transformer(specs(dtype)[0].model).to(getattr(torch, dtype))


def run_both(cache: str, dtype: str, group):
    """(policy state, draft state, (policy loaded, draft loaded) of a second call) of both warm-ups in `dtype`; the
    draft's on a fixed seeded policy (not the SFT'd one), so that it is compared on the same policy."""
    ps, ds = specs(dtype)
    policy, _, _ = warmup.warm_policy(ps, cache_dir=cache, group=group)
    draft, _ = warmup.warm_draft(seeded_policy(dtype), ds, cache_dir=cache, group=group)
    again = (warmup.warm_policy(ps, cache_dir=cache, group=group)[2],
             warmup.warm_draft(seeded_policy(dtype), ds, cache_dir=cache, group=group)[1])
    return state(policy), state(draft), again


def _ranks(rank, world, cache, dtypes):
    return {dt: run_both(os.path.join(cache, dt), dt, dist.group.WORLD) for dt in dtypes}


def moved(got: dict, ref: dict, start: dict) -> float:
    """|got - ref| / |ref - start| over every tensor end to end: the split's difference against the warm-up's update."""
    flat = lambda d: torch.cat([d[k].double().flatten() for k in sorted(ref) if d[k].is_floating_point()])  # noqa
    return float((flat(got) - flat(ref)).norm() / (flat(ref) - flat(start)).norm())


def test_split_warmups_equal_the_one_process_warmups(tmp_path):
    dtypes = ("float64", "bfloat16")
    split = run_distributed(_ranks, world_size=2, args=(str(tmp_path / "split"), dtypes), timeout=LIMIT_S)
    for dt in dtypes:
        p1, d1, again1 = run_both(str(tmp_path / "one" / dt), dt, None)
        assert again1 == (True, True)
        for r in (0, 1):
            p, d, again = split[r][dt]
            assert again == (True, True), (r, dt)  # rank 0 wrote both entries, every rank then loads them
            assert set(p) == set(p1) and set(d) == set(d1)
            for got, ref in ((p, split[0][dt][0]), (d, split[0][dt][1])):
                assert all(torch.equal(got[k], ref[k]) for k in ref), "the ranks' weights differ"
            if dt == "float64":
                for ref, got in ((p1, p), (d1, d)):
                    for k in ref:
                        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-9, msg=f"{k} ({dt})")
        if dt == "bfloat16":  # Adam's first steps are ~lr * sign(g): a bf16 gradient near 0 that rounds the other
            ps, ds = specs(dt)  # way moves its weight by ~2 lr. Measured 0.022 (policy), 0.0 (draft)
            torch.manual_seed(ps.seed)
            start = state(Transformer(ps.model))
            untrained, _ = warmup.warm_draft(seeded_policy(dt), dataclasses.replace(ds, steps=0),
                                             cache_dir=str(tmp_path / "untrained"))
            assert moved(split[0][dt][0], p1, start) < 0.1
            assert moved(split[0][dt][1], d1, state(untrained)) < 0.1


def test_gather_blocks_and_micro_batches_in_one_process():
    assert gather_blocks(7, 3, lambda items: [i * 10 for i in items], None) == [0, 10, 20, 30, 40, 50, 60]
    assert [micro_count(b) for b in (1, 4, 5, 12, 16, 64, 7)] == [1, 4, 5, 6, 8, 8, 7]


def test_master_optimizer_accumulates_16bit_grads_in_fp32():
    """Two backwards of a bf16 working copy: the fp32 master gradient is the sum of both, each added in fp32."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3, bias=False)
    w32 = lin.weight.detach().clone()
    opt = MasterOptimizer(lin.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.5), torch.bfloat16)
    lin.to(torch.bfloat16)
    xs = [torch.randn(2, 4) for _ in range(2)]
    want = torch.zeros(3, 4)
    for x in xs:
        lin(x.bfloat16()).float().sum().backward()
        want += lin.weight.grad.float()
        opt.accumulate()
        assert lin.weight.grad is None
    opt.sum_grads(torch.zeros(1), None)
    assert torch.equal(opt.master[0].grad, want)
    opt.step(grad_clip=1e9)
    assert torch.equal(opt.master[0].detach(), w32 - 0.5 * want)  # the masters started from the fp32 values
    assert torch.equal(lin.weight.detach(), (w32 - 0.5 * want).bfloat16())


def test_the_dtype_is_in_the_key():
    ps, ds = specs("float32")
    assert ps.key() != dataclasses.replace(ps, dtype="bfloat16").key()
    assert ds.key() != dataclasses.replace(ds, dtype="bfloat16").key()


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_a_bf16_warmup_computes_in_bf16_and_caches_its_working_copy(tmp_path, dtype):
    ps, _ = specs(dtype)
    policy, _, _ = warmup.warm_policy(ps, cache_dir=str(tmp_path))
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    loaded, _, hit = warmup.warm_policy(ps, cache_dir=str(tmp_path))
    assert hit and all(torch.equal(a, b) for a, b in zip(policy.parameters(), loaded.parameters()))
    assert isinstance(policy, Transformer)


def _build(rank, world, cache):
    """experiment.build_models as every rank of a GPU mesh calls it (together, the warm-ups split), on gloo."""
    mesh = Mesh(Grid(), torch.device("cpu"), rank, world, rank, world)
    s = experiment.build_models(parse_args(["--preset=test", f"--cache_dir={cache}"]), mesh.device, mesh=mesh)
    return state(s.policy), state(s.drafts["cotrained"].draft), s.warm_info["policy_cached"], sorted(os.listdir(cache))


def test_build_models_splits_the_warmups_over_the_ranks_and_caches_them_once(tmp_path):
    """The run's own path through build_models: both ranks end with the same weights, and the cache holds one policy
    and one draft entry under the keys a one-process build uses (the split is not in the key)."""
    split = run_distributed(_build, world_size=2, args=(str(tmp_path / "split"),), timeout=LIMIT_S)
    for got, ref in zip(split[1][:2], split[0][:2]):
        assert all(torch.equal(got[k], ref[k]) for k in ref), "the ranks' weights differ"
    assert split[0][2] is False and split[1][2] is False  # trained, not loaded
    one = experiment.build_models(parse_args(["--preset=test", f"--cache_dir={tmp_path / 'one'}"]),
                                  torch.device("cpu"))
    names = sorted(os.listdir(tmp_path / "one"))
    assert split[0][3] == split[1][3] == names and [n.split("-")[0] for n in names] == ["draft", "policy"]
    assert one.warm_info["policy_cached"] is False
