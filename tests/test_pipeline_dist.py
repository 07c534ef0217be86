"""Pipeline parallelism on real gloo processes against the single-process model (pipeline.py, tapchannel.py).

Every rank builds the same full model (same seed), takes its stage slice, runs one PipelineSchedule step and checks,
for several (schedule, M, dtype) cases in one spawn (spawning costs seconds on 2 cores):
  * the step's loss and draft loss, every stage parameter's gradient and the draft's gradients equal the single-process
    model on the whole batch in one packed forward (fp64 within 1e-10, fp32 within 1e-5);
  * the taps, final hidden and logits the draft hook receives for microbatch m equal a single-process forward of m
    bitwise (under CP: equal what the source rank produced bitwise, and the single-process shard within tolerance);
  * the pipeline group's P2P calls (op, peer, shape, dtype, tag) recorded per rank are identical with and without
    TapChannel and the draft hook, while TapChannel's own group did carry the taps.
"""
import copy
import functools
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from dist_util import run_distributed

from branch_mask import cu_seqlens_from_lengths
from model import EMBED_TAP, ModelConfig, Transformer
from parallel.grid import Grid
from parallel.pp_schedule import split_layers
from pipeline import Microbatch, PipelineSchedule, build_stage, shard_for_cp

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# ----------------------------------------------------------------------------------------------- shared ingredients
def make_batch(cfg, M, seed):
    """M microbatches of 2 packed sequences; labels = next token within the sequence (-100 at its end)."""
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for _ in range(M):
        lens = torch.randint(3, 10, (2,), generator=g)
        cu = cu_seqlens_from_lengths(lens)
        tok = torch.randint(cfg.vocab_size, (int(cu[-1]),), generator=g)
        lab = torch.roll(tok, -1).clone()
        lab[cu[1:].long() - 1] = -100
        mbs.append(Microbatch(tok, cu, None, {"labels": lab}))
    return mbs


def concat(mbs):  # the whole batch as one packed microbatch
    cu = [0]
    for mb in mbs:
        cu += [cu[-1] + int(x) for x in mb.cu_seqlens[1:]]
    return Microbatch(torch.cat([mb.tokens for mb in mbs]), torch.tensor(cu, dtype=torch.int32), None,
                      {"labels": torch.cat([mb.extra["labels"] for mb in mbs])})


def loss_fn(logits, mb, n):  # next-token CE, normalised by the step's target count n (additive over microbatches)
    return F.cross_entropy(logits, mb.extra["labels"], ignore_index=-100, reduction="sum") / n


def draft_loss(draft, taps, hidden, logits, mb, n):
    """A stand-in draft using every input the hook gets: reads taps + final hidden, learns the policy's distribution
    (soft CE against the detached logits) and the labels."""
    z = draft(torch.cat(list(taps) + [hidden], -1)).log_softmax(-1)
    soft = -(logits.softmax(-1) * z).sum(-1)
    keep = mb.extra["labels"] >= 0
    return ((soft * keep).sum() + F.nll_loss(z, mb.extra["labels"], ignore_index=-100, reduction="sum")) / n


class P2PRecorder:
    """Patches torch.distributed's point-to-point calls (in both namespaces, so P2POp's identity check still holds) and
    logs (op, peer, shape, dtype, tag) per process group of interest."""
    OPS = ("isend", "irecv", "send", "recv")

    def __init__(self, groups: dict):
        self.groups, self.log = groups, {name: [] for name in groups}

    def __enter__(self):
        self.saved = {op: getattr(c10d, op) for op in self.OPS}
        for op, fn in self.saved.items():
            wrapper = functools.partial(self._call, op, fn, inspect.signature(fn))
            setattr(dist, op, wrapper)
            setattr(c10d, op, wrapper)
        return self

    def _call(self, op, fn, sig, *args, **kw):
        a = sig.bind(*args, **kw).arguments
        peer = next(a[k] for k in ("dst", "src", "group_dst", "group_src") if a.get(k) is not None)
        for name, g in self.groups.items():
            if g is not None and a.get("group") is g:
                self.log[name].append((op, peer, tuple(a["tensor"].shape), str(a["tensor"].dtype), a.get("tag", 0)))
        return fn(*args, **kw)

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(dist, op, fn)
            setattr(c10d, op, fn)


# -------------------------------------------------------------------------------------------------------- one case
def run_case(grid, cfg, sizes, taps, schedule, M, dtype, seed, check_p2p=False):
    """One pipeline step on this rank, checked against the single-process model. Returns the taps this rank handed
    to TapChannel (a source) or received (the last stage), for the parent's bitwise comparison across ranks."""
    tol = TOL[dtype]
    torch.manual_seed(seed)
    full = Transformer(cfg).to(dtype)
    draft = torch.nn.Linear((len(taps) + 1) * cfg.hidden_size, cfg.vocab_size).to(dtype)
    split = split_layers(cfg.num_hidden_layers, grid.pp, sizes)
    stage = build_stage(cfg, split[grid.pp_rank], full.state_dict(), dtype)
    my_draft = copy.deepcopy(draft) if stage.is_last else None
    replicas = [make_batch(cfg, M, seed * 100 + d) for d in range(grid.dp)]  # every DP replica has its own data
    batch = replicas[grid.dp_rank]
    n = [sum(int((mb.extra["labels"] >= 0).sum()) for mb in r) for r in replicas]
    mine = [shard_for_cp(mb, grid.cp, grid.cp_rank, {"labels": -100}) for mb in batch]

    seen = {}

    def hook(d):  # records what arrived (the landing slot is reused after the hook returns: clone)
        seen[d.m] = ({k: t.clone() for k, t in d.taps.items()}, d.hidden.clone(), d.logits.clone())
        return draft_loss(my_draft, d.taps.values(), d.hidden, d.logits, d.mb, n[grid.dp_rank])

    sched = PipelineSchedule(stage, grid, split, schedule=schedule, tap_layers=taps,
                             draft_params=my_draft.parameters() if my_draft else ())
    produced = {}
    if sched.channel is not None and not stage.is_last:  # spy on what this source hands to TapChannel
        send = sched.channel.send

        def spy(m, t):
            produced[m] = {layer: t[layer].detach().clone() for layer in sched.channel.layers_of[grid.pp_rank]}
            send(m, t)
        sched.channel.send = spy
    with P2PRecorder({"pp": grid.pp_group, "tap": grid.tap_group}) as rec:
        res = sched.step(mine, functools.partial(loss_fn, n=n[grid.dp_rank]), hook)

    # reference: the full model on each replica's whole batch in one packed forward; DP = mean over replicas
    ref_loss = ref_draft = 0
    for d, r in enumerate(replicas):
        whole = concat(r)
        o = full(whole.tokens, whole.cu_seqlens, tap_layers=taps)
        lv = loss_fn(o.logits, whole, n[d])
        dv = draft_loss(draft, [o.taps[t].detach() for t in sorted(taps)], o.hidden.detach(), o.logits.detach(),
                        whole, n[d])
        ((lv + dv) / grid.dp).backward()
        ref_loss, ref_draft = ref_loss + float(lv.detach()) / grid.dp, ref_draft + float(dv.detach()) / grid.dp
    case = f"{schedule} M={M} {dtype} stage {grid.pp_rank}"
    assert abs(res.loss - ref_loss) < tol, (case, res.loss, ref_loss)
    assert abs(res.draft_loss - ref_draft) < tol, (case, res.draft_loss, ref_draft)
    ref_grads = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        err = float((p.grad - ref_grads[name].grad).abs().max())
        assert err < tol, f"{case}: grad {name} off by {err}"
    for p, q in zip(my_draft.parameters() if my_draft else (), draft.parameters()):
        assert float((p.grad - q.grad).abs().max()) < tol, f"{case}: draft grad"

    # what the hook saw vs a single-process forward of microbatch m (same shapes: bitwise equal outside CP)
    if stage.is_last:
        assert sorted(seen) == list(range(M))
        with torch.no_grad():
            for m, mb in enumerate(batch):
                o = full(mb.tokens, mb.cu_seqlens, tap_layers=taps)
                got_taps, got_h, got_logits = seen[m]
                assert sorted(got_taps) == sorted(taps)
                if grid.cp == 1:
                    for t in taps:
                        assert torch.equal(got_taps[t], o.taps[t]), f"{case}: tap {t} of microbatch {m} differs"
                    assert torch.equal(got_h, o.hidden) and torch.equal(got_logits, o.logits), case
                else:  # this rank's zigzag shard of the reference
                    from branch_mask import pad_for_cp, zigzag_shard
                    pad = pad_for_cp(mb.cu_seqlens, grid.cp)
                    cut = lambda x: zigzag_shard(pad.pad(x), pad.cu_seqlens, grid.cp, grid.cp_rank)  # noqa: E731
                    real = cut(torch.ones(mb.tokens.shape[0], dtype=torch.bool))  # padding rows hold pad tokens' states
                    for t in taps:
                        err = float((got_taps[t] - cut(o.taps[t]))[real].abs().max())
                        assert err < tol, f"{case}: tap {t} of microbatch {m} off by {err}"

    if check_p2p:  # the same step without TapChannel and without the hook: the schedule's traffic must not change
        plain = PipelineSchedule(build_stage(cfg, split[grid.pp_rank], full.state_dict(), dtype), grid, split,
                                 schedule=schedule)
        with P2PRecorder({"pp": grid.pp_group, "tap": grid.tap_group}) as rec2:
            plain.step(mine, functools.partial(loss_fn, n=n[grid.dp_rank]))
        assert rec.log["pp"], case
        assert rec2.log["pp"] == rec.log["pp"], f"{case}: pipeline P2P sequence changed by TapChannel"
        assert rec2.log["tap"] == [], case
        sends = sched.channel.layers_of[grid.pp_rank] if sched.channel and not stage.is_last else ()
        assert bool(rec.log["tap"]) == bool(sends or (stage.is_last and sched.channel.sources)), case
        assert {op for op, *_ in rec.log["tap"]} <= ({"isend"} if sends else {"irecv"}), rec.log["tap"]
    # numpy, not tensors: torch's queue shares tensors through file descriptors that die with this process
    to_np = lambda d: {m: {layer: t.numpy() for layer, t in taps.items()} for m, taps in d.items()}  # noqa: E731
    return {"coord": (grid.dp_rank, grid.cp_rank, grid.pp_rank), "case": case, "produced": to_np(produced),
            "received": to_np({m: s[0] for m, s in seen.items()})}


def check_delivery(results):
    """Parent side: for every pipeline (dp, cp), the taps that landed on the last stage are bitwise what the source
    stages produced, microbatch by microbatch."""
    by_pipe = {}
    for r in results:
        by_pipe.setdefault(r["coord"][:2], {})[r["coord"][2]] = r
    n_checked = 0
    for stages in by_pipe.values():
        last = stages[max(stages)]
        for s, r in stages.items():
            for m, taps in r["produced"].items():
                for layer, t in taps.items():
                    assert np.array_equal(last["received"][m][layer], t), (r["case"], m, layer)
                    n_checked += 1
    return n_checked


# ------------------------------------------------------------------------------------------------------ the workers
CFG6 = dict(num_hidden_layers=6)
TAPS = (EMBED_TAP, 1, 2, 5)  # stage 0 (embeddings, layer 1), a middle stage, and the last stage (used in place)


def _worker(rank, world, configs):
    """Runs several layouts in one spawn: [(pp, dp, cp, cases)], each on a fresh Grid (new groups are cheap)."""
    outs = []
    for pp, dp, cp, cases in configs:
        grid = Grid.build(pp=pp, cp=cp, dp=dp)
        for c in cases:
            cfg = ModelConfig.preset("tiny", **{**CFG6, **c.get("cfg", {})})
            outs.append(run_case(grid, cfg, c.get("sizes"), c.get("taps", TAPS), c["schedule"], c["M"],
                                 c.get("dtype", torch.float64), c.get("seed", 1), c.get("check_p2p", False)))
    return outs


def _cases(**extra):
    return [dict(schedule=s, M=M, **extra) for s in ("afab", "1f1b") for M in (1, 2, 5)]


WORLD4 = {  # one spawn of 4 processes runs all three layouts (spawning costs seconds on 2 cores)
    # PP=4: stage 2 produces no tap, layer 5 is tapped on the last stage itself
    "pp4": (4, 1, 1, _cases(check_p2p=True)),
    # PP=2 x DP=2: gradients averaged over replicas with different data; fp32; tied embeddings
    "pp2_dp2": (2, 2, 1, _cases(check_p2p=True) + [
        dict(schedule="1f1b", M=3, dtype=torch.float32),
        dict(schedule="1f1b", M=3, cfg=dict(tie_word_embeddings=True), taps=(EMBED_TAP, 2, 4))]),
    # PP=2 x CP=2: ring attention inside each stage; each CP rank's tap shard lands on the same CP rank
    "pp2_cp2": (2, 1, 2, [dict(schedule=s, M=M, check_p2p=(M == 3)) for s in ("afab", "1f1b") for M in (1, 3)]),
}


@pytest.fixture(scope="module")
def world4():
    configs = list(WORLD4.values())
    results = run_distributed(_worker, 4, args=(configs,), timeout=100)
    out, i = {}, 0
    for name, (_, _, _, cases) in WORLD4.items():
        out[name] = [[r[j] for r in results] for j in range(i, i + len(cases))]
        i += len(cases)
    return out


def _delivered(per_case):
    for ranks in per_case:  # every rank's assertions ran in the worker; here: taps landed == taps produced
        assert check_delivery(ranks) > 0


def test_pp4_matches_single_process(world4):
    _delivered(world4["pp4"])


def test_pp2_dp2_matches_single_process(world4):
    _delivered(world4["pp2_dp2"])


def test_pp2_cp2_matches_single_process(world4):
    _delivered(world4["pp2_cp2"])


def test_pp3_matches_single_process():
    """PP=3 with tied embeddings (E on the first and the last stage, grads summed), plus an explicit uneven split."""
    cases = _cases(cfg=dict(tie_word_embeddings=True)) + [
        dict(schedule="1f1b", M=4, sizes=[1, 2, 3], taps=(EMBED_TAP, 0, 2, 3), check_p2p=True)]
    res = run_distributed(_worker, 3, args=([(3, 1, 1, cases)],), timeout=90)
    _delivered([[r[j] for r in res] for j in range(len(cases))])
