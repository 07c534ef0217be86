"""draft_loss.py: the streamed TTT loss == the dense reference (loss, grads, metrics; fp64, 1e-10) for full and reduced
vocabularies, hard and soft labels, packed sequences with short ones, the logits teacher and the fused (hidden + head)
teacher, cp = 1..4 over threads and cp = 2 over gloo; the halo == the global rows; nothing of size T x V is saved."""
import copy

import pytest
import torch

from branch_mask import pad_for_cp, position_ids, seq_ids, seq_lengths, zigzag_shard
from dist_util import run_distributed
from draft_loss import halo_rows, teacher_index
from parallel.ring import as_ring, run_ranks
from test_draft import case, grads

pytestmark = pytest.mark.usefixtures("one_thread")

LENS = [7, 4, 9, 2, 1, 3]  # odd and very short sequences (1: no anchor at all)
REDUCED = torch.arange(0, 97, 2)  # even ids only: hard labels on odd ids are masked
TOL = dict(rtol=1e-10, atol=1e-10)


def run(built, *, chunk, teacher="logits", hard=False, P=3, **kw):
    """The draft's loss on a copy of `built` -> (loss, metrics, grads)."""
    policy, draft, tokens, cu, out = copy.deepcopy(built)
    src = dict(teacher_logits=out.logits) if teacher == "logits" else \
        dict(teacher_hidden=out.hidden, teacher_head=policy.lm_head.weight)
    loss, m = draft.ttt_loss(out.taps, tokens, cu, num_passes=P, hard_labels=hard, chunk=chunk, **src, **kw)
    loss.backward()
    return loss.detach(), m, grads(draft)


def assert_same(a, b, keys=("loss_per_pass", "acc", "acc_cond", "alpha", "count")):
    (la, ma, ga), (lb, mb, gb) = a, b
    torch.testing.assert_close(la, lb, **TOL)
    for k in keys:
        assert ma[k] == pytest.approx(mb[k], rel=1e-10, abs=1e-10), k
    assert ma["tau_hat"] == pytest.approx(mb["tau_hat"], rel=1e-10)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], **TOL)


@pytest.mark.parametrize("vocab", [None, "reduced"])
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_streaming_equals_dense(vocab, hard, teacher):
    """cp = 1, odd lengths (padded inside ttt_loss, the teacher read through the row map), chunks that do not divide
    T."""
    built = case(draft_vocab=REDUCED if vocab else None, lens=LENS)
    ref = run(built, chunk=0, hard=hard)  # the dense reference on the policy's logits
    for chunk in (5, 1000):
        assert_same(run(built, chunk=chunk, hard=hard, teacher=teacher), ref)


def test_dense_reference_with_fused_teacher_equals_logits():
    """The reference itself, fed the hidden + head, builds the same logits (the fused teacher's oracle)."""
    built = case(lens=LENS)
    assert_same(run(built, chunk=0, teacher="hidden"), run(built, chunk=0))


def test_nothing_of_size_T_by_V_is_saved():
    """No tensor autograd keeps for backward during the streamed loss (draft layer included) has a vocabulary axis
    over more than one chunk of rows: what is saved is O(T * H) or a weight (the LM head's gradient (Vd, H))."""
    built = case(lens=[40, 33, 50])
    policy, draft, tokens, cu, out = copy.deepcopy(built)
    T, V = tokens.shape[0], policy.cfg.vocab_size
    sizes = []

    def pack(t):
        sizes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        draft.ttt_loss(out.taps, tokens, cu, teacher_hidden=out.hidden, teacher_head=policy.lm_head.weight, chunk=16)
    big = [s for s in sizes if len(s) == 2 and s[-1] == V and s[0] > 16]
    assert len(sizes) > 20 and not big, big
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the control: the dense loss does save (T, V)
        sizes.clear()
        draft.ttt_loss(out.taps, tokens, cu, out.logits, chunk=0)
    assert any(len(s) == 2 and s[-1] == V and s[0] >= T for s in sizes)  # (T_padded, V)


# ------------------------------------------------------------------------------------------ context parallelism
CP_LENS = [13, 4, 21, 2]  # at cp = 4 the chunks are 2, 1, 3, 1 rows: the halo of P = 3 rows takes 3 hops


def _mask(cu):
    m = torch.ones(int(cu[-1]), dtype=torch.bool)
    m[(cu[1:] - 1).long()] = False  # position j predicts x_{j+1}: false at each sequence's end
    return m


def cp_rank(group, cp, built, *, hard=False, teacher="logits", chunk=4):
    policy, draft, tokens, cu, out = built
    ring = as_ring(group)
    pad = pad_for_cp(cu, cp)
    shard = lambda x, fill=0: zigzag_shard(pad.pad(x, fill), pad.cu_seqlens, cp, ring.rank)  # noqa: E731
    src = dict(teacher_logits=shard(out.logits)) if teacher == "logits" else \
        dict(teacher_hidden=shard(out.hidden), teacher_head=policy.lm_head.weight)
    loss, m = draft.ttt_loss({l: shard(t) for l, t in out.taps.items()}, shard(tokens), pad.cu_seqlens,
                             loss_mask=shard(_mask(cu), False), num_passes=3, hard_labels=hard, group=ring,
                             chunk=chunk, **src)
    loss.backward()
    return loss.detach(), m, grads(draft)


def summed(results):  # rank shares sum to the global loss; the draft's grads are summed over the CP group
    return sum(r[0] for r in results), results[0][1], {n: sum(r[2][n] for r in results) for n in results[0][2]}


def assert_cp_same(results, ref):  # every rank reports the global metrics (its own summation order: round-off)
    assert_same(summed(results), ref)
    for r in results[1:]:
        for k in ("loss_per_pass", "acc", "acc_cond", "alpha", "count"):
            assert r[1][k] == pytest.approx(ref[1][k], rel=1e-10, abs=1e-10), k


@pytest.mark.parametrize("cp,hard,vocab,teacher", [(2, False, None, "logits"), (3, True, "reduced", "hidden"),
                                                   (4, False, "reduced", "logits"), (4, True, None, "hidden")])
def test_cp_threads_equal_dense_cp1(cp, hard, vocab, teacher):
    built = case(draft_vocab=REDUCED if vocab else None, lens=CP_LENS)
    res = run_ranks(cp, lambda ring: cp_rank(ring, cp, copy.deepcopy(built), hard=hard, teacher=teacher), timeout=60)
    assert_cp_same(res, run(built, chunk=0, hard=hard))


def _gloo_worker(rank, world_size):
    import torch.distributed as dist
    built = case(lens=CP_LENS)
    loss, m, g = cp_rank(dist.group.WORLD, world_size, built, teacher="hidden")
    return float(loss), m, {n: (t.tolist(), t.dtype) for n, t in g.items()}


def test_cp_gloo_equals_dense_cp1():
    """cp = 2 over 2 real gloo processes, the fused teacher's halo (hidden rows) crossing the process boundary."""
    res = run_distributed(_gloo_worker, 2, timeout=90)
    back = [(torch.tensor(l, dtype=torch.float64), m, {n: torch.tensor(g, dtype=dt) for n, (g, dt) in gr.items()})
            for l, m, gr in res]
    assert_cp_same(back, run(case(lens=CP_LENS), chunk=0))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_teacher_index_reads_row_i_plus_d(cp):
    """[local ; halo][teacher_index(d)] == the global row i+d of every row whose i+d lies in its (padded) sequence."""
    pad = pad_for_cp(torch.tensor([0, 13, 17, 38, 40], dtype=torch.int32), cp)
    cu, n = pad.cu_seqlens, 3
    rows = torch.arange(int(cu[-1]), dtype=torch.float64)[:, None] * torch.tensor([1.0, -1.0])  # (T, 2) row ids
    pos, L = position_ids(cu), seq_lengths(cu)[seq_ids(cu)]

    def rank(ring):
        x = zigzag_shard(rows, cu, cp, ring.rank)
        both = torch.cat([x, halo_rows(x, cu // cp, n, ring).flatten(0, 2)])
        out = []
        for d in range(1, n + 1):
            got = both[teacher_index(cu // cp, d, n, cp)]
            inside = zigzag_shard(pos + d < L, cu, cp, ring.rank)
            out.append((got[inside], x[inside] + torch.tensor([d, -d])))
        return out

    for per_rank in run_ranks(cp, rank, timeout=30):
        for got, want in per_rank:
            assert got.shape[0] > 0
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_passes_count_the_chains_inference_drafts():
    """A chain from anchor i occurs at inference only once x_{i+1} was sampled by the policy: prompt n tokens,
    response to L -> pass d counts anchors n - 1 .. L - 2 - d (never i = n - 2, whose pass 1 would draft x_n, the
    token the prefill samples itself). speculators' EAGLE-3 counts pass d where x_{i+d} is a response token: the
    same anchors from pass 1, and earlier ones (i >= n - d) from pass 2 on. ~0.01 s."""
    from draft_loss import pass_targets
    n, L, P = 5, 14, 3
    tokens, cu = torch.arange(L), torch.tensor([0, L], dtype=torch.int32)
    row_mask = torch.zeros(L, dtype=torch.bool)
    row_mask[n - 1: L - 1] = True  # row j: x_{j+1} is a response token
    valid, _, count = pass_targets(tokens, cu, row_mask, P, as_ring(None), hard_labels=False, t2d=None)
    for d, v in enumerate(valid, 1):
        assert v.nonzero()[:, 0].tolist() == list(range(n - 1, L - 1 - d)), d
    assert count.tolist() == [L - n - d for d in range(1, P + 1)]
