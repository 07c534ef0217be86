"""draft_dspark.py: the chunked, checkpointed DSpark loss equals its dense formula in fp64 (value and gradients, the
Markov head included), and proposals sampled left to right through the Markov head are lossless (greedy ==
autoregressive, TV against the exact distribution of the first tokens). ~15 s on 2 CPU cores."""
import math

import pytest
import torch
import torch.nn.functional as F

from block_cases import oracle
from branch_mask import cu_seqlens_from_lengths
from draft_block import default_gamma, sample_anchors
from draft_dspark import DSparkDraft
from model import ModelConfig, Transformer, greedy_generate
from parallel.ring import as_ring
from spec_cases import exact_first3
from speculative import generate

pytestmark = pytest.mark.usefixtures("one_thread")


def packed(seqs):
    return torch.cat(seqs), cu_seqlens_from_lengths([len(s) for s in seqs])


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny")).double().eval()


def dense_loss(draft, out, tokens, cu, mask, anchors):
    """0.1 CE + 0.9 L1 + BCE(confidence, alpha) per slot k (teacher p_{a+k}, prev = x_{a+k}), weights exp(-k/gamma),
    summed over every trained (anchor, slot) pair and divided by their count,
    gamma = default_gamma(W + 1); the confidence head reads [norm(h_k); W1[prev]]."""
    h = draft.block_forward(out.taps, tokens, cu, anchors, attn_fn=oracle)
    T, W = len(tokens), draft.cfg.block_size
    seq_end = cu[1:].long()[torch.searchsorted(cu[1:].long(), anchors, right=True)]
    p_all = torch.softmax(out.logits.double(), -1)
    loss, count = 0.0, 0
    for k in range(W):
        t = (anchors + k).clamp(max=T - 1)
        ok = (anchors + k < seq_end) & mask[t]
        count = count + ok.sum()
        xm = torch.cat([draft.norm(h[:, k]), draft.markov_in(tokens[t])], -1)  # (N, H + r)
        z = F.linear(xm, draft.head())
        q, p = torch.softmax(z, -1), p_all[t]
        alpha = torch.minimum(p, q).sum(-1).detach()
        bce = F.binary_cross_entropy_with_logits(draft.confidence(xm)[:, 0], alpha, reduction="none")
        rows = 0.1 * -(p * torch.log_softmax(z, -1)).sum(-1) + 0.9 * (q - p).abs().sum(-1) + bce
        loss = loss + math.exp(-k / default_gamma(W + 1)) * (rows * ok).sum()
    return loss / count.clamp_min(1)  # one mean over every trained (anchor, slot) pair


def test_chunked_loss_equals_dense(policy):
    torch.manual_seed(2)
    draft = DSparkDraft.from_target(policy, mask_token_id=0, block_size=4, markov_rank=5)
    with torch.no_grad():
        draft.markov_out.weight.normal_(0, 0.5)  # the head is live, not the zero start
        draft.confidence.weight.normal_(0, 0.5)
    seqs = [torch.randint(1, 97, (n,)) for n in (11, 7, 16)]
    tokens, cu = packed(seqs)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[cu[1:].long() - 1] = False
    mask[:3] = False
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=mask, anchors=4, seed=3, chunk=3)
    loss.backward()
    got = [p.grad.clone() for p in draft.parameters()]
    draft.zero_grad()
    ref = dense_loss(draft, out, tokens, cu, mask, sample_anchors(tokens, cu, mask, 4, 3, as_ring(None)))
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-10)
    for g, p in zip(got, draft.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-10)
    assert draft.markov_out.weight.grad.abs().sum() > 0 and len(m["alpha"]) == 4


def test_greedy_equals_autoregressive(policy):
    draft = DSparkDraft.from_target(policy, mask_token_id=0, block_size=3, markov_rank=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (int(n),), generator=g) for n in torch.randint(1, 7, (5,), generator=g)]
    ref = greedy_generate(policy, prompts, 16)
    for k in (1, 3):  # k = W: every slot drafts
        r = generate(policy, draft, prompts, max_new_tokens=16, num_draft_tokens=k, temperature=0)
        assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref]


def tv_first3(q_backbone_only=False):
    """TV of the first 3 tokens' empirical distribution from the exact one, and the bound of test_speculative
    (delta = 1e-6). q_backbone_only: the bug where the accept rule sees the backbone's q, not the Markov head's."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=6)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() == 2:
                p.mul_(25)
    draft = DSparkDraft.from_target(policy, mask_token_id=5, block_size=2, tap_layers=(0, 1), markov_rank=3)
    with torch.no_grad():
        draft.markov_out.weight.normal_(0, 3.0)  # the second draft depends on the first
    prompt, N, V, tau = torch.tensor([1, 4, 2]), 8000, 6, 1.0
    p = exact_first3(policy, prompt, tau)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    if q_backbone_only:
        propose = draft.propose

        def wrong(cache, state, k, t, g):
            d, _ = propose(cache, state, k, t, g)
            return d, torch.softmax(draft.logits(draft.run_block(cache, state[0])[:, :k]) / t, -1)
        draft.propose = wrong
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, num_draft_tokens=2, temperature=tau,
                 generator=torch.Generator().manual_seed(9))
    emp = torch.bincount(torch.stack(r.tokens) @ torch.tensor([V * V, V, 1]), minlength=V ** 3).double() / N
    return 0.5 * (emp.view(V, V, V) - p).abs().sum().item(), bound, r.stats


def test_sampling_matches_exact_distribution():
    tv, bound, stats = tv_first3()
    assert tv < bound
    assert 0.05 < stats.accepted / stats.drafted < 0.95


def test_sampling_test_has_power():
    tv, bound, _ = tv_first3(q_backbone_only=True)
    assert tv > 2 * bound
