"""Single-process checks of pipeline.py: the layer split, the two schedules (simulated on P virtual stages: complete,
deadlock-free, and tap_depth is exactly the worst-case number of a source's taps in flight), the world
size 1 step against a plain forward/backward, and the loud errors. The multi-process runs are test_pipeline_dist.py."""
import pytest
import torch
import torch.nn.functional as F

from model import EMBED_TAP, ModelConfig, Transformer
from test_pipeline_dist import make_batch
from parallel.grid import Grid
from parallel.pp_schedule import schedule_actions, split_layers, tap_depth
from pipeline import PipelineSchedule, build_stage


@pytest.fixture(autouse=True)
def one_thread():  # tiny shapes: a second intra-op thread only adds barrier waits (badly so on a busy 2-core box)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_split_layers_even_explicit_and_errors():
    assert split_layers(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]  # remainder to the earliest stages
    assert split_layers(6, 3, sizes=[1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    assert split_layers(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 pipeline stages"):
        split_layers(4, 5)
    for bad in ([1, 2], [3, 3, 0], [2, 2, 3]):
        with pytest.raises(ValueError, match="layer split"):
            split_layers(6, 3, sizes=bad)


def _simulate(schedule, P, M):
    """Run the P stages' action lists with async sends and blocking receives, the last stage as slowly as possible
    (sources run ahead as far as the dependencies allow). Returns the max taps in flight per source stage."""
    acts = [schedule_actions(schedule, P, s, M) for s in range(P)]
    pc, fwd, bwd, n_fwd = [0] * P, set(), set(), [0] * P
    in_flight = [0] * P
    while any(pc[s] < len(acts[s]) for s in range(P)):
        ready = [s for s in range(P) if pc[s] < len(acts[s]) and (
            (acts[s][pc[s]][0] == "F" and (s == 0 or (s - 1, acts[s][pc[s]][1]) in fwd)) or
            (acts[s][pc[s]][0] == "B" and (s == P - 1 or (s + 1, acts[s][pc[s]][1]) in bwd)))]
        assert ready, f"{schedule} P={P} M={M}: deadlock at {pc}"
        s = min(ready, key=lambda r: (r == P - 1, r))  # the last stage only when nobody else can move
        kind, m = acts[s][pc[s]]
        (fwd if kind == "F" else bwd).add((s, m))
        n_fwd[s] += kind == "F"
        pc[s] += 1
        for src in range(P - 1):
            in_flight[src] = max(in_flight[src], n_fwd[src] - n_fwd[P - 1])
    return in_flight[:-1]


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_schedules_complete_without_deadlock_and_ring_depth_is_tight(schedule):
    for P in range(1, 7):
        for M in range(1, 10):
            for s in range(P):
                acts = schedule_actions(schedule, P, s, M)
                assert sorted(acts) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
                assert all(acts.index(("F", m)) < acts.index(("B", m)) for m in range(M))
                alive = max(sum(1 for k, _ in acts[:i + 1] if k == "F") - sum(1 for k, _ in acts[:i + 1] if k == "B")
                            for i in range(len(acts)))
                assert alive == (M if schedule == "afab" else min(M, P - s))  # activations held by stage s
            if P > 1:
                worst = _simulate(schedule, P, M)
                assert max(worst) == tap_depth(schedule, P, M), (P, M, worst)  # exact: a source's pending tap sends


def test_world_size_1_is_gradient_accumulation_with_the_draft_hook():
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", num_hidden_layers=4)
    full = Transformer(cfg).double()
    stage = build_stage(cfg, (0, 4), full.state_dict(), torch.float64)
    taps = (EMBED_TAP, 1, 3)
    draft = torch.nn.Linear(len(taps) * cfg.hidden_size, cfg.vocab_size).double()
    mbs = make_batch(cfg, 3, seed=0)
    loss_fn = lambda logits, mb: F.cross_entropy(logits, mb.extra["labels"], ignore_index=-100, reduction="sum")  # noqa

    def hook(d):
        assert sorted(d.taps) == list(taps) and not d.logits.requires_grad and not d.hidden.requires_grad
        return loss_fn(draft(torch.cat(list(d.taps.values()), -1)), d.mb)

    res = PipelineSchedule(stage, Grid.build(), [(0, 4)], tap_layers=taps, draft_params=draft).step(mbs, loss_fn, hook)
    g_draft = [p.grad.clone() for p in draft.parameters()]
    draft.zero_grad()
    ref = ref_d = 0
    for mb in mbs:
        out = full(mb.tokens, mb.cu_seqlens, tap_layers=taps)
        ref = ref + loss_fn(out.logits, mb)
        ref_d = ref_d + loss_fn(draft(torch.cat([out.taps[t].detach() for t in taps], -1)), mb)
    (ref + ref_d).backward()
    assert abs(res.loss - float(ref.detach())) < 1e-10 and abs(res.draft_loss - float(ref_d.detach())) < 1e-10
    for (name, p), q in zip(stage.named_parameters(), full.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-10, name
    for g, p in zip(g_draft, draft.parameters()):
        assert (g - p.grad).abs().max() < 1e-10


def test_bad_config_errors():
    cfg = ModelConfig.preset("tiny", num_hidden_layers=4)
    stage, grid = build_stage(cfg, (0, 4)), Grid.build()
    with pytest.raises(ValueError, match="out of range"):
        PipelineSchedule(stage, grid, [(0, 4)], tap_layers=(EMBED_TAP, 4))
    with pytest.raises(ValueError, match="out of range"):
        PipelineSchedule(stage, grid, [(0, 4)], tap_layers=(-2,))
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        PipelineSchedule(stage, grid, [(0, 4)], schedule="gpipe")
    with pytest.raises(ValueError, match="a step needs M >= 1"):
        PipelineSchedule(stage, grid, [(0, 4)]).step([], lambda logits, mb: logits.sum())
    with pytest.raises(ValueError, match="split"):  # stage slice and split disagree
        PipelineSchedule(build_stage(cfg, (0, 2)), grid, [(0, 4)])
    with pytest.raises(ValueError, match="world size 1"):
        Grid.build(pp=2)
    with pytest.raises(ValueError, match="M=0 microbatches"):
        schedule_actions("1f1b", 2, 0, 0)


def test_grad_buckets_cover_every_gradient_in_order_within_the_budget():
    from pipeline import grad_buckets
    grads = [torch.zeros(n) for n in (10, 300, 5, 5, 2000, 1, 64)] + [torch.zeros(7, dtype=torch.float64)]
    mib = 1200 / 2**20  # 300 fp32 values per bucket
    buckets = grad_buckets(grads, mib)
    assert [t for b in buckets for t in b] == grads  # every gradient once, in order (the same tensors)
    for b in buckets:
        assert len(b) == 1 or sum(t.numel() * t.element_size() for t in b) <= 1200  # a larger one alone
        assert len({t.dtype for t in b}) == 1
    assert [len(b) for b in buckets] == [1, 1, 2, 1, 2, 1]
