"""The block drafters' loss under context parallelism: each of cp ranks (threads over a ThreadRing) holds its zigzag
shard of the taps, tokens, mask and teacher; anchors, blocks and targets (the teacher at a + k, read across ranks
through the halo) follow their positions. The ranks' losses sum to the one-process loss, their gradients likewise,
fp64, for DFlash and DSpark, with anchors at chunk edges and blocks crossing a sequence's end, and with a rank that
holds no anchor. ~15 s on 2 CPU cores.
"""
import copy

import pytest
import torch

from branch_mask import cu_seqlens_from_lengths, pad_for_cp, position_ids, seq_ids, zigzag_shard
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from model import ModelConfig, Transformer
from parallel.ring import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family,cp", [(DFlashDraft, 2), (DFlashDraft, 3), (DSparkDraft, 2)])
def test_cp_loss_equals_one_process(family, cp):
    check_cp(family, cp)


@pytest.mark.parametrize("family", [DFlashDraft, DSparkDraft])
def test_rank_without_anchors_joins_the_backward(family):
    """Response rows only in each sequence's first zigzag chunk (rank 0's): rank 1 holds no anchor, yet its loss is a
    zero on the graph, so it joins the ring's backward (its trunk K/V serve rank 0's blocks) and the sum still equals
    one process."""
    def first_chunk(cu, pad, cp):
        pos = position_ids(pad.cu_seqlens)  # (T_pad,)
        C = (pad.cu_seqlens[1:] - pad.cu_seqlens[:-1]).long() // (2 * cp)  # (S,) rows per zigzag chunk
        m = (pos < C[seq_ids(pad.cu_seqlens).long()])[pad.index]
        m[cu[1:].long() - 1] = False
        return m
    check_cp(family, 2, mask_of=first_chunk, empty_rank=1)


def check_cp(family, cp, mask_of=None, empty_rank=None):
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    kw = dict(markov_rank=4) if family is DSparkDraft else {}
    draft = family.from_target(policy, mask_token_id=0, block_size=4, **kw)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lengths = [13, 6, 21]
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(1, 97, (sum(lengths),))
    mask = torch.rand(len(tokens)) < 0.8
    mask[cu[1:].long() - 1] = False  # the last row of a sequence predicts nothing
    pad = pad_for_cp(cu, cp)
    gcu = pad.cu_seqlens
    mask = mask if mask_of is None else mask_of(cu, pad, cp)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    opts = dict(anchors=5, seed=3, chunk=4)
    ref, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=mask, **opts)
    ref.backward()
    assert sum(m["count"]) > 0  # some rank trains
    want = [p.grad.clone() for p in draft.parameters()]

    def rank(ring):
        d = copy.deepcopy(draft)
        d.zero_grad()
        d.attach(policy)
        sh = lambda x, fill=0: zigzag_shard(pad.pad(x, fill), gcu, cp, ring.rank)  # noqa: E731
        if ring.rank == empty_rank:
            assert not sh(mask, False).any()  # no response row, hence no anchor on this rank
        loss, met = d.loss({l: sh(t) for l, t in out.taps.items()}, sh(tokens), gcu, sh(out.logits),
                           loss_mask=sh(mask, False), group=ring, **opts)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in d.parameters()], met
    res = run_ranks(cp, rank, timeout=120)
    assert torch.allclose(sum(r[0] for r in res), ref, atol=1e-10)
    for i, g in enumerate(want):
        assert torch.allclose(sum(r[1][i] for r in res), g, atol=1e-10)
    assert res[0][2]["count"] == m["count"] and abs(res[0][2]["tau_hat"] - m["tau_hat"]) < 1e-10
