"""DSpark's confidence cut (draft_dspark.propose, speculative.verify's lengths): a row's proposal ends before its first
slot with c_k < threshold, c_k read from [norm(h_k); W1[prev_k]] before slot k samples; the engine verifies the shorter
proposal exactly (the accept / residual / bonus rule per row length, greedy == autoregressive, the first three tokens'
distribution end to end); the flag, DSpark's default block (k slots, each one proposed) and gamma (4.0 at W = 7).
~6 s on 2 CPU cores (3 s of it imports)."""
import math

import pytest
import torch

from draft_block import default_gamma
from draft_dspark import DSparkDraft
from harness import drafters
from harness.config import parse_args
from harness.experiment import build_task
from model import ModelConfig, Transformer, greedy_generate
from spec_cases import exact_first3, peaked_policy
from speculative import generate, residual, verify

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny")).double().eval()


def live_draft(policy, W=4, thr=0.5, seed=1):
    """A DSpark draft whose Markov and confidence heads are live (random, not the zero start): c_k varies with the
    previous token, so rows are cut at different slots."""
    torch.manual_seed(seed)
    draft = DSparkDraft.from_target(policy, mask_token_id=0, block_size=W, markov_rank=4, confidence_threshold=thr)
    with torch.no_grad():
        draft.markov_out.weight.normal_(0, 1.0)
        draft.confidence.weight.normal_(0, 1.0)
    return draft


def tv_bound(p, N):  # E[TV] + McDiarmid's t at delta = 1e-6 (test_speculative.py's bound)
    return 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))


def test_verify_with_lengths_is_exact():
    """verify at fixed p (positions independent of the prefix): among rows that reach position j, the token emitted
    there is ~ p_j, for rows cut at every length 0..k. A row's bonus after its last proposed draft is drawn from p, not
    from the residual against the unproposed slot's q (which this test tells apart: TV > 3 bounds)."""
    g = torch.Generator().manual_seed(0)
    B, k, V = 400000, 3, 5
    p_logits = (torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 0.5).expand(B, -1, -1)
    q1 = torch.softmax(torch.randn(k, V, generator=g, dtype=torch.float64) * 2, -1)
    q = q1.expand(B, -1, -1)
    d = torch.multinomial(q1[None].expand(B // 100, -1, -1).reshape(-1, V), 100, True, generator=g)  # (B/100 * k, 100)
    d = d.view(B // 100, k, 100).permute(0, 2, 1).reshape(B, k)  # (B, k) row b's draft j ~ q_j
    lengths = torch.arange(B) % (k + 1)  # (B,) every length 0..k
    n, y = verify(p_logits, d, q, 1.0, g, lengths)
    assert (n <= lengths).all()
    p = torch.softmax(p_logits[0], -1)
    out = torch.cat([d, torch.zeros_like(d[:, :1])], 1)
    out[torch.arange(B), n] = y  # (B, k+1) the emitted tokens d_1..d_n, y, then junk
    for L in range(k + 1):
        for j in range(L + 1):
            rows = (lengths == L) & (n >= j)
            emp = torch.bincount(out[rows, j], minlength=V).double() / rows.sum()
            bound = tv_bound(p[j], int(rows.sum()))
            assert 0.5 * (emp - p[j]).abs().sum() < bound
            if j == L < k:  # the power: the residual against the unproposed slot L's q is far from p_L
                assert 0.5 * (residual(p[L], q1[L]) - p[L]).abs().sum() > 3 * bound
    g0 = p_logits.argmax(-1)  # tau = 0: n = the leading matches, at most the row's length; y = argmax p_n
    n0, y0 = verify(p_logits, g0[:, :k].clone(), None, 0.0, None, lengths)
    assert torch.equal(n0, lengths) and torch.equal(y0, g0[torch.arange(B), lengths])


@torch.no_grad()
def test_propose_cuts_before_the_first_unconfident_slot(policy):
    """lengths[b] = the first slot whose sigmoid(w . [norm(h_k); W1[prev_k]] + b) < threshold (prev_0 the anchor,
    prev_k slot k-1's token), k if none; the cut changes no sampled token (the same stream: slots are all drawn)."""
    draft = live_draft(policy)
    B, n, k = 64, 6, 4
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 97, (B, n), generator=g)
    with torch.no_grad():
        out = policy(tokens.flatten(), torch.arange(0, B * n + 1, n, dtype=torch.int32), tap_layers=draft.tap_layers)
    cache = draft.new_cache(B, n + k + 1)
    state = draft.extend(cache, tokens[:, 1:], {l: t.view(B, n, -1)[:, :-1] for l, t in out.taps.items()},
                         torch.full((B,), n - 2))
    for tau in (0.0, 1.0):
        d, q, lengths = draft.propose(cache, state, k, tau, torch.Generator().manual_seed(5))
        draft.cfg.confidence_threshold = 0.0
        d_all, q_all = draft.propose(cache, state, k, tau, torch.Generator().manual_seed(5))
        draft.cfg.confidence_threshold = 0.5
        assert d.shape[1] == int(lengths.max()) and torch.equal(d, d_all[:, : d.shape[1]])
        assert (q is None) == (tau == 0) and (q is None or torch.equal(q, q_all[:, : d.shape[1]]))
        h = draft.run_block(cache, state[0])  # (B, W, H)
        prev = torch.cat([state[0][:, None], d_all[:, :-1]], 1)  # (B, k)
        c = torch.sigmoid(draft.confidence_logit(draft.norm(h[:, :k]), draft.markov_in(prev)))  # (B, k)
        first = torch.where((c < 0.5).any(1), (c < 0.5).long().argmax(1), k)
        assert torch.equal(lengths, first)
        assert len(set(lengths.tolist())) >= 3  # rows cut at different slots, some after slot 0


def test_greedy_with_the_cut_equals_autoregressive(policy):
    draft = live_draft(policy, W=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (int(n),), generator=g) for n in torch.randint(1, 7, (5,), generator=g)]
    ref = greedy_generate(policy, prompts, 16)
    for k in (1, 3):
        r = generate(policy, draft, prompts, max_new_tokens=16, num_draft_tokens=k, temperature=0)
        assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref]
        st = r.stats
        assert 0 < st.drafted < k * st.row_steps and st.accepted <= st.drafted  # cut, yet drafting
        assert sum(len(t) for t in r.tokens) == st.new_tokens == len(prompts) + st.kept


def first3(anticipating=False, N=8000):
    """TV of the first 3 tokens of N sampled rows from the exact distribution, and the bound, with the cut on (k = 2,
    W = 2; c_k reads W1[prev_k] alone, so a row's cut turns on the token before the slot). anticipating: the bug the
    paper's appendix A warns of, slot k's cut read from its OWN token's W1 row (decided after the token is drawn),
    which biases the output."""
    policy = peaked_policy()
    draft = DSparkDraft.from_target(policy, mask_token_id=5, block_size=2, tap_layers=(0, 1), markov_rank=3,
                                    confidence_threshold=0.5)
    H = draft.cfg.hidden_size
    with torch.no_grad():
        draft.markov_out.weight.normal_(0, 1.0)
        draft.confidence.weight[:, :H] = 0  # c_k reads W1[prev_k] alone: admission turns on the token before it
        draft.confidence.weight[:, H:].normal_(0, 3.0)
    if anticipating:
        def propose(cache, state, k, t, g):
            draft.cfg.confidence_threshold = 0.0
            d, q = DSparkDraft.propose(draft, cache, state, k, t, g)
            draft.cfg.confidence_threshold = 0.5
            x = draft.norm(draft.run_block(cache, state[0])[:, :k])
            c = torch.sigmoid(draft.confidence_logit(x, draft.markov_in(d)))  # reads d_k itself: anticipating
            return d, q, (c >= 0.5).long().cumprod(1).sum(1)
        draft.propose = propose
    prompt, V, tau = torch.tensor([1, 4, 2]), 6, 1.0
    p = exact_first3(policy, prompt, tau)
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, num_draft_tokens=2, temperature=tau,
                 generator=torch.Generator().manual_seed(9))
    emp = torch.bincount(torch.stack(r.tokens) @ torch.tensor([V * V, V, 1]), minlength=V ** 3).double() / N
    return 0.5 * (emp.view(V, V, V) - p).abs().sum().item(), tv_bound(p, N), r.stats


def test_sampling_with_the_cut_matches_exact_distribution():
    tv, bound, st = first3()
    assert tv < bound
    assert 0 < st.accepted < st.drafted < 2 * st.row_steps  # cut often, never always


def test_sampling_test_sees_an_anticipating_cut():
    tv, bound, _ = first3(anticipating=True, N=16000)  # measured 2.5 bounds
    assert tv > 2 * bound


def test_flag_reaches_the_draft_and_defaults():
    """--confidence_threshold: DeepSpec's default 0 (off), checked in [0, 1], DSpark only, carried to the draft (its
    config, so a saved or fresh copy keeps it). --block_size=0 gives DSpark k slots, all proposed (DFlash: k + 1)."""
    assert parse_args(["--drafter=dspark"]).confidence_threshold == 0.0
    for bad in (["--drafter=dspark", "--confidence_threshold=1.5"],
                ["--drafter=dspark", "--confidence_threshold=-0.1"]):
        with pytest.raises(ValueError, match=r"^--confidence_threshold=\S+: expected in \[0, 1\]"):
            parse_args(bad)
    with pytest.raises(ValueError, match=r"^--confidence_threshold=0.3: only --drafter dspark reads it"):
        parse_args(["--drafter=dflash", "--confidence_threshold=0.3"])
    cfg = parse_args(["--drafter=dspark", "--num_draft_tokens=3", "--confidence_threshold=0.4"])
    tsk = build_task(cfg)
    policy = Transformer(ModelConfig.preset("mini", vocab_size=18))
    d = drafters.build_draft("dspark", policy, drafters.options(cfg, tsk))
    assert d.cfg.confidence_threshold == 0.4 and d.fresh(policy).cfg.confidence_threshold == 0.4
    assert d.cfg.block_size == d.max_draft_tokens == 3  # trains slots 0..2, proposes 3: none trained unproposed
    assert tuple(d.confidence.weight.shape) == (1, d.cfg.hidden_size + d.cfg.markov_rank)
    assert parse_args(["--drafter=dflash", "--num_draft_tokens=3"]).block_slots == 4
    assert parse_args(["--drafter=dspark", "--num_draft_tokens=2", "--eval_draft_tokens=5"]).block_slots == 5
    assert parse_args(["--drafter=dspark", "--num_draft_tokens=1"]).block_slots == 2  # DFlashConfig's floor
    with pytest.raises(ValueError, match="confidence_threshold=2"):
        DSparkDraft.from_target(policy, mask_token_id=0, block_size=3, confidence_threshold=2)


def test_gamma_default_is_deepspec_at_block_7(policy):
    """A DSpark block of W drafts weighs its slots as a DFlash block of W + 1 (W - 1 drafts and the anchor): gamma
    default_gamma(W + 1), 4.0 at W = 7 (DeepSpec's loss_decay_gamma at block_size 7), not default_gamma(7) = 3.5."""
    assert default_gamma(8) == 4.0 and default_gamma(7) == 3.5
    torch.manual_seed(2)
    draft = DSparkDraft.from_target(policy, mask_token_id=0, block_size=7, markov_rank=4)
    tokens = torch.randint(1, 97, (40,))
    cu = torch.tensor([0, 40], dtype=torch.int32)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
        loss = {g: draft.loss(out.taps, tokens, cu, out.logits, anchors=6, seed=1, gamma=g)[0].item()
                for g in (None, 4.0, 3.5)}
    assert loss[None] == loss[4.0] != loss[3.5]
