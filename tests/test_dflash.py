"""draft_dflash.py / draft_block.py: the training block equals the inference block, the streamed block loss equals a
dense fp64 reference (value and gradients), anchors are seeded, bounded and mesh-independent, and DFlash proposals
through speculative.generate are lossless (greedy == autoregressive, TV against the exact distribution, GRPO's
log-probs the policy's). ~15 s on 2 CPU cores."""
import math

import pytest
import torch

from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard
from draft_block import default_gamma, sample_anchors
from draft_dflash import DFlashDraft, default_dflash_taps
from draft_dspark import DSparkDraft
from model import ModelConfig, Transformer, greedy_generate
from parallel.ring import as_ring, run_ranks
from block_cases import oracle
from spec_cases import exact_first3
from speculative import generate

pytestmark = pytest.mark.usefixtures("one_thread")


def packed(seqs):
    return torch.cat(seqs), cu_seqlens_from_lengths([len(s) for s in seqs])


def train(policy, draft, seqs, steps=40, lr=1e-2):
    tokens, cu = packed(seqs)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    hist = []
    for i in range(steps):
        loss, m = draft.loss(out.taps, tokens, cu, out.logits, anchors=6, seed=i)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hist.append(m)
    return hist[0], hist[-1]


@pytest.fixture(scope="module")
def pair():
    """A tiny fp64 policy and a DFlash draft (W = 4) trained briefly on its greedy continuations."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    prompts = [torch.randint(1, 97, (int(n),), generator=g) for n in torch.randint(2, 6, (12,), generator=g)]
    seqs = [torch.cat([p, o]) for p, o in zip(prompts, greedy_generate(policy, prompts, 24))]
    draft = DFlashDraft.from_target(policy, mask_token_id=0, block_size=4)
    first, last = train(policy, draft, seqs)
    return policy, draft, (first, last)


def test_default_taps():
    """z-lab's build_target_layer_ids: one tap per draft layer (n // 2 for one), spread over 1 .. n-3 with Python's
    round (10 layers, 5 draft layers: 1 + 1.5 j -> 2.5 rounds to 2); small n pushed apart instead of repeated."""
    assert default_dflash_taps(36, 5) == (1, 9, 17, 25, 33) and default_dflash_taps(28, 5) == (1, 7, 13, 19, 25)
    assert default_dflash_taps(36, 3) == (1, 17, 33) and default_dflash_taps(36, 1) == (18,)
    assert default_dflash_taps(10, 5) == (1, 2, 4, 6, 7)
    assert default_dflash_taps(6, 5) == (1, 2, 3, 4, 5) and default_dflash_taps(6, 3) == (1, 2, 3)
    assert default_dflash_taps(6, 1) == (3,) and default_dflash_taps(4, 3) == (1, 2, 3)
    assert default_dflash_taps(1, 1) == default_dflash_taps(1, 3) == (0,) and default_dflash_taps(2, 2) == (0, 1)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=8))
    for L in (1, 2, 3):  # the draft's default: as many taps as its layers
        assert DFlashDraft.from_target(policy, mask_token_id=0, num_layers=L).tap_layers == default_dflash_taps(8, L)
    assert DSparkDraft.from_target(policy, mask_token_id=0, num_layers=3).tap_layers == (1, 3, 5)
    with pytest.raises(ValueError, match="num_draft_layers=0"):
        default_dflash_taps(36, 0)
    assert [default_gamma(W) for W in (8, 10, 16)] == [4, 5, 7]


def test_training_block_equals_inference_block(pair):
    """block_forward at anchor a (training: context j < a, the block bidirectional) == extend over positions < a,
    then run_block from x_a (inference), to fp64 round-off."""
    policy, draft, _ = pair
    torch.manual_seed(1)
    seqs = [torch.randint(1, 97, (n,)) for n in (10, 14)]
    tokens, cu = packed(seqs)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
        anchors = torch.tensor([0, 1, 5, 9, 10, 10 + 3, 10 + 13])  # sequence starts, chunk edges, blocks past the end
        h = draft.block_forward(out.taps, tokens, cu, anchors)  # (N, W, H), the ring attention at cp = 1
        assert torch.allclose(h, draft.block_forward(out.taps, tokens, cu, anchors, attn_fn=oracle), atol=1e-12)
        for n, a in enumerate(anchors.tolist()):
            s = 0 if a < 10 else 10
            cache = draft.new_cache(1, 32)
            if a > s:
                state = draft.extend(cache, tokens[None, s + 1: a + 1], {l: t[None, s:a] for l, t in out.taps.items()},
                                     torch.tensor([a - s - 1]))
                assert int(state[0]) == int(tokens[a])
            ref = draft.run_block(cache, tokens[a: a + 1])
            assert torch.allclose(h[n], ref[0], atol=1e-10), (n, a)


def dense_block_loss(draft, out, tokens, cu, mask, anchors):
    """speculators' layout and reduction (models/dflash/metrics.py, losses/utils.py loss_function), fp64: the flat
    (N, W) slots, slot k predicting x_{a+k} against p_{a+k-1}, m = x_{a+k} is a response token (slot 0, the anchor,
    never), w_k = exp(-max(k - 1, 0) / gamma) [k > 0], L = sum(w m ce) / sum(m). CE against p where speculators'
    default is KL(p || q): the same up to p's entropy, which has no gradient."""
    h = draft.block_forward(out.taps, tokens, cu, anchors, attn_fn=oracle)  # unpadded, the dense oracle
    p = torch.softmax(out.logits.double(), -1)  # (T, V)
    T, W = len(tokens), draft.cfg.block_size
    seq_end = cu[1:].long()[torch.searchsorted(cu[1:].long(), anchors, right=True)]
    k = torch.arange(W)
    idx = anchors[:, None] + k  # (N, W) the position each slot predicts
    t = (idx - 1).clamp(0, T - 1)  # its teacher's row
    m = (idx < seq_end[:, None]) & mask[t] & (k > 0)  # (N, W)
    w = torch.exp(-(k - 1).clamp(min=0).double() / default_gamma(W)) * (k > 0)  # (W,)
    ce = -(p[t] * torch.log_softmax(draft.logits(h), -1)).sum(-1)  # (N, W)
    return (w * m * ce).sum() / m.sum()


def test_streamed_loss_equals_dense(pair):
    policy, _, _ = pair
    torch.manual_seed(2)
    draft = DFlashDraft.from_target(policy, mask_token_id=0, block_size=5)
    seqs = [torch.randint(1, 97, (n,)) for n in (11, 7, 16)]
    tokens, cu = packed(seqs)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[cu[1:].long() - 1] = False  # the last row of a sequence predicts nothing
    mask[:3] = False  # a prompt
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=mask, anchors=3, seed=5, chunk=7)
    loss.backward()
    got = [p.grad.clone() for p in draft.parameters()]
    draft.zero_grad()
    anchors = sample_anchors(tokens, cu, mask, 3, 5, as_ring(None))
    ref = dense_block_loss(draft, out, tokens, cu, mask, anchors)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-10)
    for g, p in zip(got, draft.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-10)
    assert m["count"][0] == len(anchors) and len(m["alpha"]) == 4
    assert len(set(m["count"])) > 1  # slots past a sequence's end: a mean per slot would differ from the one mean


def test_anchors_bounded_seeded_and_mesh_independent():
    torch.manual_seed(3)
    lengths = [12, 20, 8]
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(1, 50, (sum(lengths),))
    mask = torch.rand(len(tokens)) < 0.7
    a = sample_anchors(tokens, cu, mask, 4, seed=1, ring=as_ring(None))
    ok = mask & torch.cat([torch.zeros(1, dtype=torch.bool), mask[:-1]])  # loss_mask at a - 1 and at a ...
    ok[cu[:-1].long()] = False  # ... within the sequence
    assert ok[a].all() and torch.equal(a, a.sort().values)
    per_seq = torch.bincount(torch.searchsorted(cu[1:].long(), a, right=True), minlength=3)
    assert per_seq.tolist() == [min(4, int(ok[s:e].sum())) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert not torch.equal(a, sample_anchors(tokens, cu, mask, 4, seed=2, ring=as_ring(None)))
    for cp in (2, 3):  # the same global positions when the sequences are zigzag-sharded over cp ranks
        pad = pad_for_cp(cu, cp)
        tk, mk = pad.pad(tokens), pad.pad(mask, False)
        seq = torch.searchsorted(cu[1:].long(), a, right=True)
        ref = torch.zeros(int(pad.cu_seqlens[-1]), dtype=torch.bool)
        ref[pad.cu_seqlens.long()[seq] + a - cu.long()[seq]] = True  # the anchors' rows in the padded layout

        def rank(ring):
            loc = sample_anchors(zigzag_shard(tk, pad.cu_seqlens, cp, ring.rank), pad.cu_seqlens,
                                 zigzag_shard(mk, pad.cu_seqlens, cp, ring.rank), 4, seed=1, ring=ring)
            hit = torch.zeros(len(tk) // cp, dtype=torch.bool)
            hit[loc] = True
            return torch.equal(hit, zigzag_shard(ref, pad.cu_seqlens, cp, ring.rank))
        assert all(run_ranks(cp, rank, timeout=60))


def test_anchors_are_the_blocks_inference_drafts():
    """Inference starts the first block at the first response token y ~ p(. | prompt) (speculative.prefill), never at
    the last prompt token: with a prompt of n tokens and a response ending at L, the anchors are n .. L - 2 (x_a and
    x_{a+1} response tokens), n - 1 never, however many are asked for. The blocks they train, one per anchor."""
    lengths, prompts = [12, 9], [5, 1]
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(1, 50, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(len(tokens), dtype=torch.bool)  # row j: the prediction of x_{j+1} counts
    for s, L, n in zip(cu[:-1].tolist(), lengths, prompts):
        mask[s + n - 1: s + L - 1] = True
    want = torch.cat([torch.arange(s + n, s + L - 1) for s, L, n in zip(cu[:-1].tolist(), lengths, prompts)])
    for seed in range(4):
        assert torch.equal(sample_anchors(tokens, cu, mask, 100, seed=seed, ring=as_ring(None)), want)
    for seed in range(8):
        a = sample_anchors(tokens, cu, mask, 2, seed=seed, ring=as_ring(None))
        assert len(a) == 4 and all(x in want.tolist() for x in a.tolist())


def test_training_learns(pair):
    first, last = pair[2]
    assert last["loss_per_pass"][0] < first["loss_per_pass"][0] and last["alpha"][0] > first["alpha"][0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_autoregressive(pair, k):
    policy, draft, _ = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (int(n),), generator=g) for n in torch.randint(1, 7, (5,), generator=g)]
    ref = greedy_generate(policy, prompts, 20)
    r = generate(policy, draft, prompts, max_new_tokens=20, num_draft_tokens=k, temperature=0)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref]
    assert 0 < r.stats.accepted < r.stats.drafted  # both the accept and the reject path ran


@pytest.mark.parametrize("tau", [0.7, 1.0])
def test_sampling_matches_exact_distribution(tau):
    """TV between the empirical and the exact distribution of the first 3 tokens under DFlash proposals (k = 2 from
    one block), below the bound of test_speculative.test_sampling_matches_exact_distribution (delta = 1e-6)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=6)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() == 2:
                p.mul_(25)
    draft = DFlashDraft.from_target(policy, mask_token_id=5, block_size=3, tap_layers=(0, 1))
    with torch.no_grad():
        draft.fc.weight.normal_(0, 2.0)
    prompt, N, V = torch.tensor([1, 4, 2]), 8000, 6
    p = exact_first3(policy, prompt, tau)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, num_draft_tokens=2, temperature=tau,
                 generator=torch.Generator().manual_seed(7))
    idx = torch.stack(r.tokens) @ torch.tensor([V * V, V, 1])
    emp = torch.bincount(idx, minlength=V ** 3).double().view(V, V, V) / N
    assert 0.5 * (emp - p).abs().sum().item() < bound
    assert 0.05 < r.stats.accepted / r.stats.drafted < 0.95


def test_logprobs_are_the_policys(pair):
    policy, draft, _ = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 97, (int(n),), generator=g) for n in (3, 5, 2)]
    r = generate(policy, draft, prompts, max_new_tokens=12, num_draft_tokens=3, temperature=1.0,
                 generator=torch.Generator().manual_seed(0))
    tokens, cu = packed([torch.cat([p, t]) for p, t in zip(prompts, r.tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(policy(tokens, cu).logits, -1)
    for b, (p, t) in enumerate(zip(prompts, r.tokens)):
        rows = int(cu[b]) + len(p) - 1 + torch.arange(len(t))
        assert torch.allclose(r.logprobs[b], logp[rows, t], atol=1e-9)


def test_refuses_chain_only_features(pair):
    policy, draft, _ = pair
    for kw in (dict(num_draft_tokens=4), dict(num_draft_tokens=2, tree=(2, 1))):
        with pytest.raises(ValueError, match="block drafter"):
            generate(policy, draft, [torch.tensor([1, 2])], max_new_tokens=4, temperature=0, **kw)


def test_no_anchor_is_a_zero_loss(pair):
    """A batch (or a CP rank's shard) without a response position: loss 0 with a graph, counts 0, no NaN."""
    policy, draft, _ = pair
    tokens, cu = packed([torch.randint(1, 97, (n,)) for n in (6, 8)])
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=torch.zeros(14, dtype=torch.bool), anchors=3)
    loss.backward()
    assert float(loss.detach()) == 0 and m["count"] == [0, 0, 0]
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in draft.parameters())
    draft.zero_grad()


def test_dspark_no_anchor_is_a_zero_loss_on_the_graph(pair):
    """DSpark likewise: its loss without anchors is a zero attached to the block's graph (backward runs), not a
    float, so a CP rank without anchors still joins the ring's backward (test_dflash_cp.py)."""
    policy = pair[0]
    draft = DSparkDraft.from_target(policy, mask_token_id=0, block_size=3, markov_rank=4)
    tokens, cu = packed([torch.randint(1, 97, (n,)) for n in (6, 8)])
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=torch.zeros(14, dtype=torch.bool), anchors=3)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    loss.backward()
    assert float(loss.detach()) == 0 and m["count"] == [0, 0, 0]
    assert all(p.grad is None or (p.grad == 0).all() for p in draft.parameters())
