"""nccl_check.py: the NCCL model flags the two schedules a review found (the crossed lazy communicator creation at
the first step, the 1F1B send/send pair), passes every supported layout of today's schedule, and the traces it checks
are what the real code issues: one gloo run per layout family (pp only, pp x cp, pp x dp), recorded, equals the
generated trace."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_util import run_distributed

from model import EMBED_TAP, ModelConfig, Transformer, default_tap_layers
from commcheck.comm_trace import CommRecorder, comparable, layout_traces
from commcheck.nccl_check import simulate

N_LAYERS = 8
TAPS = default_tap_layers(N_LAYERS) + (EMBED_TAP,)


# ------------------------------------------------------------------------------------------------- the simulator
def _call(cid, kind, group, *ops):
    return ("call", cid, kind, group, tuple(ops))


def test_simulator_rules_on_hand_made_traces():
    g = ("g", (0, 1))
    ok = {0: [_call(1, "p2p", g, ("send", 1, 4)), ("wait", 1)], 1: [_call(1, "p2p", g, ("recv", 0, 4)), ("wait", 1)]}
    assert simulate(ok) == []
    # both send first on one communicator: each send waits for a receive queued behind the other's send (rule 3)
    crossed = {r: [_call(1, "p2p", g, ("send", 1 - r, 4)), _call(2, "p2p", g, ("recv", 1 - r, 4)), ("wait", 2)]
               for r in (0, 1)}
    err = simulate(crossed)
    assert len(err) == 2 and all("queued behind #1 p2p [send" in e for e in err), err
    # the same two ops in one batch (one NCCL group) complete
    assert simulate({r: [_call(1, "batch", g, ("send", 1 - r, 4), ("recv", 1 - r, 4)), ("wait", 1)]
                     for r in (0, 1)}) == []
    # a send nobody receives, a size mismatch, and a collective one member never joins
    assert "never matched" in simulate({0: [_call(1, "p2p", g, ("send", 1, 4)), _call(2, "p2p", g, ("send", 1, 4))],
                                        1: [_call(1, "p2p", g, ("recv", 0, 4)), ("wait", 1)]})[0]
    assert "mismatch" in simulate({0: [_call(1, "p2p", g, ("send", 1, 4)), ("wait", 1)],
                                   1: [_call(1, "p2p", g, ("recv", 0, 8)), ("wait", 1)]})[0]
    three = ("h", (0, 1, 2))
    err = simulate({r: [_call(1, "coll", three, ("all_reduce", None, None)), ("wait", 1)] for r in (0, 1)} | {2: []})
    assert len(err) == 2 and "never join" in err[0], err


def test_stream_waits_queue_later_calls_and_block_the_host_only_at_a_sync():
    """Rule 4 (NCCL's waits, parallel/waits.py): after a stream wait the host runs on, and what it issues next starts
    on the device only once the waited call is complete; the host blocks at a host sync. Rank 0 waits for a receive,
    then must join a communicator that rank 1 creates before it sends: under stream waits rank 0's host gets there;
    with a host sync after the wait (or every wait blocking the host, waits="host") both ranks hang."""
    pp, new = ("pp", (0, 1)), ("g", (0, 1))
    warm = [_call(9, "coll", pp, ("all_reduce", None, None)), ("wait", 9)]
    r0 = warm + [_call(1, "batch", pp, ("recv", 1, 4)), ("wait", 1), _call(2, "coll", new, ("all_reduce", None, None)),
                 ("wait", 2)]
    r1 = warm + [_call(1, "coll", new, ("all_reduce", None, None)), _call(2, "batch", pp, ("send", 0, 4)), ("wait", 2)]
    assert simulate({0: r0, 1: r1}) == []
    err = simulate({0: r0, 1: r1}, waits="host")
    assert len(err) == 2 and "rank 0: wait #1 of #1 batch [recv <- rank 1]" in err[0], err
    assert "blocks creating the communicator" in err[1], err
    err = simulate({0: r0[:4] + [("host",)] + r0[4:], 1: r1})
    assert err[0].startswith("rank 0: host sync waits for #1 batch [recv <- rank 1] on pp"), err
    # each rank's send is issued after a stream wait on the other's: both hosts finish, the device order hangs
    cross = {r: warm + [_call(1, "batch", pp, ("recv", 1 - r, 4)), ("wait", 1), _call(2, "batch", pp,
                                                                                       ("send", 1 - r, 4))]
             for r in (0, 1)}
    err = simulate(cross)
    assert len(err) == 2 and all("queued on the stream behind its wait #1" in e for e in err), err
    with pytest.raises(ValueError, match="waits='poll': expected one of"):
        simulate(cross, waits="poll")


# ------------------------------------------------------------------------------------- the old and the new schedule
def test_flags_the_old_crossed_communicator_creation():
    """Before the warm-up: the last stage first touches TapChannel's pair (the old irecvs posted at begin), stage 0
    first the pipeline's link. Also the batched schedule needed the warm-up."""
    for fused in (False, True):
        err = simulate(layout_traces(2, 1, 1, "1f1b", 2, taps=TAPS, n_layers=N_LAYERS, warm=False, fused=fused,
                                     post_ahead=True))
        assert len(err) == 2 and all("blocks creating the communicator" in e for e in err), err
        assert "('pp', (0, 1))" in err[0] and "('tap', (0, 1))" in err[1], err


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_flags_the_old_1f1b_send_send_pair(pp):
    """Old 1F1B, communicators warmed: stage s's "send act(m+w)" and stage s+1's "send grad(m)" each sit in front of
    the receive the other waits for. M = 1 has no steady state and passes; AFAB never crosses."""
    assert simulate(layout_traces(pp, 1, 1, "1f1b", 1, warm=True, fused=False)) == []
    assert simulate(layout_traces(pp, 1, 1, "afab", 4, warm=True, fused=False)) == []
    for M in (2, 5):
        err = simulate(layout_traces(pp, 1, 1, "1f1b", M, warm=True, fused=False))
        pair = [e for e in err if "queued behind" in e and "p2p [send" in e.split("queued behind")[1]]
        assert len(pair) >= 2, err  # two ranks, each waiting behind its own send to the other


def test_every_supported_layout_is_deadlock_free():
    """pp 2-4 x M 1-8 x cp 1-2 x dp 1-2, both schedules, with and without drafts (embedding tap included, the draft
    exchanging on the CP ring too), tied and untied embeddings."""
    n = 0
    for pp, M, cp, dp, schedule, draft, tied in itertools.product((2, 3, 4), range(1, 9), (1, 2), (1, 2),
                                                                   ("1f1b", "afab"), (False, True), (False, True)):
        traces = layout_traces(pp, cp, dp, schedule, M, taps=TAPS if draft else (), n_layers=N_LAYERS,
                               draft_cp=draft, tied=tied)
        assert simulate(traces) == [], (pp, M, cp, dp, schedule, draft, tied)
        n += 1
    assert n == 768


# ------------------------------------------------------------------------------------ device-wide synchronisation
def test_a_device_sync_waits_for_every_posted_receive():  # adds ~1 s
    """Rule 5 on a hand-made trace: rank 1 posts a receive on one communicator whose send rank 0 issues only after
    rank 1's send on another; without a sync in between it completes, with one it hangs."""
    tap, pp = ("tap", (0, 1)), ("pp", (0, 1))
    warm = [_call(8, "coll", pp, ("all_reduce", None, None)), ("wait", 8),
            _call(9, "coll", tap, ("all_reduce", None, None)), ("wait", 9)]  # both communicators exist
    r0 = warm + [_call(1, "batch", pp, ("recv", 1, 4)), ("wait", 1), _call(2, "batch", tap, ("send", 1, 4)),
                 ("wait", 2)]
    r1 = warm + [_call(1, "batch", tap, ("recv", 0, 4)), _call(2, "batch", pp, ("send", 0, 4)), ("wait", 2),
                 ("wait", 1)]
    assert simulate({0: r0, 1: r1}) == []
    err = simulate({0: r0, 1: r1[:5] + [("sync",)] + r1[5:]})
    assert len(err) == 2 and err[1].startswith("rank 1: device sync waits for #1 batch [recv <- rank 0] on tap"), err


def test_tap_receives_posted_at_forward_survive_device_syncs_and_posting_ahead_does_not():
    """A device sync inside every action of every rank (an out-of-memory retry can strike wherever a rank allocates),
    drafts on: TapChannel posting m's receives as the last stage starts F(m) passes every layout; the old channel,
    which pre-posted depth microbatches and re-posted m + depth after m's draft, hangs on every layout from M = 3 on:
    a receive is posted whose send needs the last stage's gradient or a send stuck behind it (1F1B, P = 2, M = 3:
    the sync in B(0) waits for microbatch 2's taps, which stage 0 sends only after its own B(0))."""
    bad = {True: [], False: []}
    for ahead, pp, M, cp, dp, schedule in itertools.product((False, True), (2, 3, 4), range(1, 9), (1, 2), (1, 2),
                                                            ("1f1b", "afab")):
        traces = layout_traces(pp, cp, dp, schedule, M, taps=TAPS, n_layers=N_LAYERS, draft_cp=True,
                               device_sync=True, post_ahead=ahead)
        if simulate(traces):
            bad[ahead].append((pp, M, cp, dp, schedule))
    assert bad[False] == [], bad[False]
    assert len(bad[True]) == 144 and all(M >= 3 for _, M, _, _, _ in bad[True]), bad[True]  # every layout, M >= 3
    err = simulate(layout_traces(2, 1, 1, "1f1b", 3, taps=TAPS, n_layers=N_LAYERS, device_sync=True, post_ahead=True))
    assert any("device sync waits for" in e and "on tap" in e for e in err), err


# -------------------------------------------------------------------------------- recorded == generated, on gloo
def _record(rank, world, layouts):
    from branch_mask import cp_shift
    from parallel.grid import Grid
    from parallel.pp_schedule import split_layers
    from pipeline import PipelineSchedule, build_stage, shard_for_cp
    from test_pipeline_dist import make_batch
    out = []
    for pp, cp, dp, schedule, M in layouts:
        cfg = ModelConfig.preset("tiny", num_hidden_layers=N_LAYERS)
        torch.manual_seed(0)
        full = Transformer(cfg)
        with CommRecorder() as rec:
            grid = Grid.build(pp=pp, cp=cp, dp=dp)
            split = split_layers(N_LAYERS, pp)
            stage = build_stage(cfg, split[grid.pp_rank], full.state_dict())
            mbs = [shard_for_cp(mb, cp, grid.cp_rank, {"labels": -100}) for mb in make_batch(cfg, M, 7)]

            def hook(d):  # a draft that talks on the CP ring, as the real one does (cp_shift, ring attention)
                x = d.hidden.clone().requires_grad_()
                y = cp_shift(x, d.mb.cu_seqlens, 1, group=grid.cp_group)[0] if cp > 1 else x
                return (y * sum(d.taps.values())).mean() * 0

            sched = PipelineSchedule(stage, grid, split, schedule=schedule, tap_layers=TAPS)
            sched.step(mbs, lambda logits, mb: F.cross_entropy(logits, mb.extra["labels"], ignore_index=-100), hook)
        names = {pg: name for (name, _), pg in grid.handles.items()}
        out.append((comparable(rec.events(names)), [mb.tokens.shape[0] for mb in mbs], cfg.tie_word_embeddings,
                    cfg.hidden_size))
    return out


LAYOUTS = [(4, 1, 1, "1f1b", 5), (2, 2, 1, "1f1b", 3), (2, 1, 2, "afab", 3)]  # (pp, cp, dp, schedule, M)


def test_recorded_gloo_traces_equal_the_generated_ones():
    res = run_distributed(_record, 4, args=(LAYOUTS,), timeout=120)
    for i, (pp, cp, dp, schedule, M) in enumerate(LAYOUTS):
        _, tokens, tied, hidden = res[0][i]
        gen = layout_traces(pp, cp, dp, schedule, M, taps=TAPS, n_layers=N_LAYERS, draft_cp=True, tied=tied,
                            tokens=tokens, hidden=hidden, itemsize=4)
        for rank in range(4):
            got = res[rank][i][0]
            want = comparable(gen[rank])
            assert got == want, (LAYOUTS[i], rank, next(((j, a, b) for j, (a, b) in enumerate(zip(got, want))
                                                         if a != b), (len(got), len(want))))
            assert any(ev[0] == "call" and ev[3][0] == "tap" for ev in got) or pp == 1
        assert simulate(gen) == []
