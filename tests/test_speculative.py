"""speculative.py: greedy == plain greedy (ours and transformers'), the sampling rule is lossless (exactly, and
empirically end to end), rollout log-probs == a fresh policy forward, stats, and loud errors."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

import speculative
from draft import Eagle3Draft
from serving.hf_io import from_pretrained
from branch_mask import cu_seqlens_from_lengths
from model import ModelConfig, Transformer, greedy_generate
from modeling.kv_cache import KVCache
from decoding.k_control import KSchedule
from decoding.spec_stats import SpecCounts
from spec_cases import SWITCHING, exact_first3, make_small_vocab_pair
from speculative import accept_prob, generate, residual


pytestmark = pytest.mark.usefixtures("one_thread")


def packed(seqs):
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    return torch.cat(seqs), cu


def ragged_prompts(g, B, vocab, lo=1, hi=7):
    return [torch.randint(vocab, (int(n),), generator=g) for n in torch.randint(lo, hi + 1, (B,), generator=g)]


def train_draft(policy, draft, seqs, steps=30, lr=1e-2):
    """A few TTT steps on the policy's own continuations (hard labels: fast to fit). Returns (first, last) metrics."""
    tokens, cu = packed(seqs)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    hist = []
    for _ in range(steps):
        loss, m = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=2, hard_labels=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hist.append(m)
    return hist[0], hist[-1]


@pytest.fixture(scope="module")
def pair():
    """A tiny fp64 policy (its greedy continuations fall into cycles) and two drafts trained on them briefly: one with
    the full vocabulary and one with a reduced 48-token vocabulary, so both accept and reject paths run."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    prompts = ragged_prompts(g, 12, policy.cfg.vocab_size, 2, 5)
    seqs = [torch.cat([p, o]) for p, o in zip(prompts, greedy_generate(policy, prompts, 24))]
    full = Eagle3Draft.from_target(policy)
    first, last = train_draft(policy, full, seqs)
    counts = torch.bincount(torch.cat(seqs), minlength=policy.cfg.vocab_size)
    reduced = Eagle3Draft.from_target(policy, draft_vocab=counts.argsort(descending=True)[:48])
    train_draft(policy, reduced, seqs)
    return policy, full, reduced, (first, last)


def test_ttt_training_learns(pair):
    first, last = pair[3]
    assert last["acc"][0] > first["acc"][0] + 0.3 and last["loss_per_pass"][0] < first["loss_per_pass"][0]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 6, "reduced", "switching", "off"])
def test_greedy_equals_autoregressive(pair, k):
    policy, full, reduced, _ = pair
    draft, k = (reduced, 3) if k == "reduced" else (full, k)
    adapt = {"switching": KSchedule(SWITCHING[2]),  # k changes every step (0 included)
             "off": KSchedule(SWITCHING[2], off_after=4)}.get(k)  # then speculation off, the draft dropped
    k = adapt.max_k if adapt else k
    prompts = ragged_prompts(torch.Generator().manual_seed(1), 5, policy.cfg.vocab_size)
    ref = greedy_generate(policy, prompts, 20)
    r = generate(policy, draft, prompts, max_new_tokens=20, num_draft_tokens=k, temperature=0, adapt=adapt)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref]
    if k:  # the draft is good but not perfect: both the accept and the reject path ran
        assert 0 < r.stats.accepted < r.stats.drafted


def test_greedy_eos_mid_draft(pair, monkeypatch):
    policy, draft = pair[0], pair[1]
    dropped, keep_rows = [], KVCache.keep_rows
    monkeypatch.setattr(KVCache, "keep_rows", lambda c, keep: (dropped.append(len(keep)), keep_rows(c, keep)))
    prompts = ragged_prompts(torch.Generator().manual_seed(2), 6, policy.cfg.vocab_size)
    ref = greedy_generate(policy, prompts, 24)
    eos = int(ref[0][6])  # a token of a cycle: it recurs inside accepted draft blocks
    r = generate(policy, draft, prompts, max_new_tokens=24, num_draft_tokens=4, temperature=0, eos_id=eos)
    for got, want in zip(r.tokens, ref):
        hit = (want == eos).nonzero()
        want = want[: int(hit[0]) + 1] if len(hit) else want
        assert got.tolist() == want.tolist()
    assert any(len(t) < 24 for t in r.tokens) and any(t[-1] == eos and len(t) > 1 for t in r.tokens)
    assert dropped  # finished rows left the batch (both caches shrunk) while the others kept generating


def test_greedy_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(cfg).double().eval()
    hf.save_pretrained(tmp_path)
    policy = from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    draft = Eagle3Draft.from_target(policy)
    prompts = ragged_prompts(torch.Generator().manual_seed(3), 3, 61, 2, 6)
    r = generate(policy, draft, prompts, max_new_tokens=16, num_draft_tokens=3, temperature=0)
    for p, got in zip(prompts, r.tokens):
        want = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=16,
                           do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):]
        assert got.tolist() == want.tolist()


@given(st.integers(2, 6), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.3]))
def test_accept_residual_is_exact(V, seed, zero_frac):
    """sum_d q(d) [a(d) 1{x=d} + (1 - a(d)) r(x)] = p(x), computed exactly (fp64), q with and without zeros."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(V, generator=g, dtype=torch.float64) * (torch.rand(V, generator=g) >= zero_frac)
    q[int(torch.randint(V, (1,), generator=g))] += 0.1  # at least one proposable token
    p, q = p / p.sum(), q / q.sum()
    for qq in (q, p.clone()):  # also q == p: nothing is ever rejected and the residual falls back to p
        out = torch.zeros(V, dtype=torch.float64)
        r = residual(p, qq)
        for d in range(V):
            if qq[d] > 0:
                a = accept_prob(p[d], qq[d])
                out[d] += qq[d] * a
                out += qq[d] * (1 - a) * r
        assert torch.allclose(out, p, atol=1e-12)




def empirical_first3(policy, draft, prompt, tau, N, seed, adapt=None):
    V = policy.cfg.vocab_size
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, num_draft_tokens=adapt.max_k if adapt else 2,
                 temperature=tau, generator=torch.Generator().manual_seed(seed), adapt=adapt)
    idx = torch.stack(r.tokens) @ torch.tensor([V * V, V, 1])
    return torch.bincount(idx, minlength=V ** 3).double().view(V, V, V) / N, r.stats


@pytest.fixture(scope="module")
def small_vocab_pair():
    return make_small_vocab_pair()


@pytest.mark.parametrize("tau", [0.7, 1.0])
def test_sampling_matches_exact_distribution(small_vocab_pair, tau):
    """Total variation between the empirical and the exact distribution of the first 3 tokens, N samples, below
    E[TV] + t with E[TV] <= 1/2 sum_x sqrt(p(1-p)/N) and P(TV - E[TV] >= t) <= exp(-2 N t^2) (McDiarmid), delta=1e-6."""
    policy, draft = small_vocab_pair
    prompt, N = torch.tensor([1, 4, 2]), 8000
    p = exact_first3(policy, prompt, tau)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    emp, stats = empirical_first3(policy, draft, prompt, tau, N, seed=int(tau * 10))
    assert 0.5 * (emp - p).abs().sum().item() < bound
    assert 0.05 < stats.accepted / stats.drafted < 0.95  # the mismatch is real: many rejections, some accepts


@pytest.mark.parametrize("ks, off", [(SWITCHING[0], None), (SWITCHING[1], None), ((2,), 1)])
def test_switching_k_matches_exact_distribution(small_vocab_pair, ks, off):
    """The same bound with k switching between steps (k = 0 then a chain, and a chain then k = 0: the draft's trunk
    catches up over the autoregressive steps' taps; a chain step, then speculation off for the rest of the call, the
    draft dropped: off=1). ~6 s each."""
    policy, draft = small_vocab_pair
    prompt, N, tau = torch.tensor([1, 4, 2]), 8000, 1.0
    p = exact_first3(policy, prompt, tau)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    emp, stats = empirical_first3(policy, draft, prompt, tau, N, seed=11, adapt=KSchedule(ks, off_after=off))
    assert 0.5 * (emp - p).abs().sum().item() < bound
    assert 0 < stats.drafted < 2 * stats.row_steps  # both kinds of step ran (a chain step alone drafts 2 per row)


def test_sampling_test_has_power(small_vocab_pair, monkeypatch):
    """The classic bug -- on rejection resample from p instead of norm(max(p - q, 0)) -- fails the bound above."""
    policy, draft = small_vocab_pair
    prompt, N, tau = torch.tensor([1, 4, 2]), 8000, 1.0
    p = exact_first3(policy, prompt, tau)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    emp, _ = empirical_first3(policy, draft, prompt, tau, N, seed=3)
    assert 0.5 * (emp - p).abs().sum().item() > 2 * bound


@pytest.mark.parametrize("tau,k", [(1.0, 3), (0.7, 0), (0.0, 2), (1.0, SWITCHING[2])])
def test_logprobs_equal_fresh_forward(pair, tau, k):
    policy, draft = pair[0], pair[1]
    prompts = ragged_prompts(torch.Generator().manual_seed(4), 4, policy.cfg.vocab_size)
    kw = dict(max_new_tokens=12, num_draft_tokens=max(k) if isinstance(k, tuple) else k, temperature=tau, eos_id=5)
    adapt = (lambda: KSchedule(k)) if isinstance(k, tuple) else (lambda: None)  # noqa: E731
    r = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(0), adapt=adapt(), **kw)
    again = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(0), adapt=adapt(), **kw)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in again.tokens]  # seeded: reproducible
    tokens, cu = packed([torch.cat([p, t]) for p, t in zip(prompts, r.tokens)])
    with torch.no_grad():
        z = policy(tokens, cu).logits
    logp = torch.log_softmax(z / (tau or 1.0), -1)
    for b, (p, t) in enumerate(zip(prompts, r.tokens)):
        rows = int(cu[b]) + len(p) - 1 + torch.arange(len(t))  # the position predicting each generated token
        assert torch.allclose(r.logprobs[b], logp[rows, t], atol=1e-9)


def test_stats(pair):
    policy, draft = pair[0], pair[1]
    prompts = ragged_prompts(torch.Generator().manual_seed(5), 3, policy.cfg.vocab_size)
    ar = generate(policy, None, prompts, max_new_tokens=10, num_draft_tokens=4, temperature=0)
    assert (ar.stats.policy_forwards, ar.stats.acceptance_length, ar.stats.accept_per_position) == (9, 1.0, [])
    assert ar.stats.new_tokens == 30 and ar.stats.tokens_per_s > 0
    s = generate(policy, draft, prompts, max_new_tokens=10, num_draft_tokens=4, temperature=0).stats
    assert s.acceptance_length == pytest.approx(1 + s.accepted / s.row_steps)
    assert s.drafted == 4 * s.row_steps and len(s.accept_per_position) == 4
    assert all(0 <= a <= 1 for a in s.accept_per_position) and s.new_tokens == 30
    assert s.acceptance_length * s.row_steps >= 3 * 9  # every row made its 9 decode tokens
    empty = generate(policy, draft, prompts, max_new_tokens=0, num_draft_tokens=2)
    assert [len(t) for t in empty.tokens] == [0, 0, 0]


def test_bad_input(pair):
    policy, draft = pair[0], pair[1]
    ok = [torch.tensor([1, 2, 3])]
    with pytest.raises(ValueError, match="prompts"):
        generate(policy, draft, [], max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        generate(policy, draft, ok + [torch.tensor([], dtype=torch.long)], max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        generate(policy, draft, [torch.tensor([1.0, 2.0])], max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate(policy, draft, ok, max_new_tokens=4, num_draft_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate(policy, draft, ok, max_new_tokens=4, num_draft_tokens=2, temperature=-0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(policy, draft, ok, max_new_tokens=-1, num_draft_tokens=2)
    with pytest.raises(ValueError, match="adapt: expected a chain draft"):
        generate(policy, draft, ok, max_new_tokens=4, num_draft_tokens=2, tree=(2, 1), adapt=KSchedule((0, 2)))
    with pytest.raises(ValueError, match="ceiling K=2"):
        generate(policy, draft, ok, max_new_tokens=4, num_draft_tokens=3, adapt=KSchedule((0, 2)))
    other = Eagle3Draft.from_target(Transformer(ModelConfig.preset("tiny", vocab_size=50)).double())
    with pytest.raises(ValueError, match="vocab_size"):
        generate(policy, other, ok, max_new_tokens=4, num_draft_tokens=2)


class _StubCache:  # lengths + rollback: all commit needs of a KV cache
    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def rollback(self, lengths):
        self.lengths = lengths.clone()


def test_acceptance_hand_count():
    """Two verification forwards (k = 3, EOS = 9, max_new_tokens = 6) counted by hand. Every row got 1 prefill token.
    forward 1: row 0 keeps all 4 (n = 3); row 1 accepts 3 but the 2nd token is EOS: keeps 2 and stops; row 2 keeps 2
               (n = 1).                                                   kept 4 + 2 + 2 over 3 active rows
    forward 2: row 0 (5 tokens) has a budget of 1: keeps 1 of its 4 and stops; row 1 is done (not active); row 2
               rejects at once and its correction is EOS: keeps 1.      kept 1 + 1 over 2 active rows
    acceptance length = (8 + 2) / (3 + 2) = 2.0, where counting n + 1 per forward would say (4 + 4 + 2 + 4 + 1) / 5:
    the uncut length vLLM's counters give, 1 + (3 + 3 + 1 + 3 + 0) / 5 = 3.0."""
    k, B, eos = 3, 3, torch.tensor([9])  # (E,) the ids that end a row
    s = speculative._Decode(k, 1.0, eos, 6, None, toks=torch.zeros(B, 6 + 2 * (k + 1), dtype=torch.long),
                            lps=torch.zeros(B, 6 + 2 * (k + 1)), n_gen=torch.ones(B, dtype=torch.long),
                            live=torch.arange(B), y=torch.tensor([1, 1, 1]), done=torch.zeros(B, dtype=torch.bool),
                            pcache=_StubCache([10, 10, 10]), counts=SpecCounts(B, k, k, "cpu"))
    z = torch.zeros(B, k + 1, 11)
    speculative.commit(s, torch.tensor([[2, 3, 4, 5], [2, 9, 4, 5], [2, 3, 0, 0]]), z, torch.tensor([3, 3, 1]))
    assert s.done.tolist() == [False, True, False] and s.n_gen.tolist() == [5, 3, 3]
    speculative.commit(s, torch.tensor([[6, 7, 8, 2], [0, 0, 0, 0], [9, 0, 0, 0]]), z, torch.tensor([3, 3, 0]))
    st = speculative.finish(s, 1.0).stats
    assert (st.kept, st.row_steps, st.acceptance_length) == (10, 5, 2.0)
    assert st.accepted == 5 and st.drafted == 15 and st.new_tokens == 6 + 3 + 4 == B + st.kept
    assert (st.accepted_uncut, st.acceptance_length_uncut) == (10, 3.0)
    # per position j, kept positions only (tried: j <= n and j < kept; accepted: j < n and j < kept):
    # fwd 1 tried rows 0,1,2 / 0,1,2 / 0 and accepted 0,1,2 / 0,1 / 0; fwd 2 tried rows 0,2 at j = 0, accepted row 0
    assert st.accept_per_position == pytest.approx([4 / 5, 2 / 3, 1 / 1])
    assert (st.row_kept, st.row_forwards, st.row_accepted) == ([5, 2, 3], [2, 1, 2], [4, 2, 1])  # per prompt


@pytest.mark.parametrize("k", [0, 2, 4, SWITCHING[2]])
def test_acceptance_counts_only_kept_tokens(pair, k):
    """End to end with EOS and max_new_tokens cuts: the tokens returned are exactly one prefill token per row plus
    the numerator of the acceptance length (each row's last forward counts only what it keeps). A tuple: k switches."""
    policy, draft = pair[0], pair[1]
    ks, k = (k, max(k)) if isinstance(k, tuple) else (None, k)
    prompts = ragged_prompts(torch.Generator().manual_seed(2), 6, policy.cfg.vocab_size)
    eos = int(greedy_generate(policy, prompts, 24)[0][6])  # recurs inside accepted draft blocks
    for max_new in (4, 7, 24):
        for tau in (0.0, 1.0):
            r = generate(policy, draft, prompts, max_new_tokens=max_new, num_draft_tokens=k, temperature=tau,
                         eos_id=eos, generator=torch.Generator().manual_seed(max_new),
                         adapt=KSchedule(ks) if ks else None)
            st = r.stats
            assert sum(len(t) for t in r.tokens) == st.new_tokens == len(prompts) + st.kept
            assert 1.0 <= st.acceptance_length <= k + 1 and st.kept == st.row_steps + st.accepted
            assert st.accepted <= st.accepted_uncut <= k * st.row_steps  # the stopping forwards counted whole
            assert sum(st.row_kept) == st.kept and sum(st.row_forwards) == st.row_steps
            assert all(len(t) == 1 + kp for t, kp in zip(r.tokens, st.row_kept))  # per prompt too
