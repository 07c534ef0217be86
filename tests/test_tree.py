"""speculative_tree.py: the tree forward equals fresh forwards of every root-to-node path; greedy == plain greedy for
several trees; the verification rule's output distribution, computed exactly by enumerating the candidate draws and
integrating over the uniforms, equals the policy's (and the computation catches top-k candidates or a missing update);
end to end the first three tokens match the exact distribution at tau = 1 and 0.7; ragged rows with EOS inside an
accepted path; log-probs == a fresh forward; tree = (1,) * k is the chain."""
import itertools
import math

import pytest
import torch

import speculative
from decoding import speculative_tree
from branch_mask import cu_seqlens_from_lengths
from modeling.kv_cache import TreeLayout
from model import ModelConfig, Transformer, greedy_generate
from spec_cases import briefly_trained_draft, exact_first3, make_small_vocab_pair
from speculative import generate
from decoding.speculative_tree import Tree, tree_rule, tree_rule_naive

pytestmark = pytest.mark.usefixtures("one_thread")
TREES = [(1,), (2,), (2, 2, 1), (3, 2), (1, 1, 1, 1), (4, 2, 2, 1)]


def packed(seqs):
    return torch.cat(seqs), cu_seqlens_from_lengths([len(s) for s in seqs])


def ragged_prompts(seed, B, vocab, lo=1, hi=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (int(n),), generator=g) for n in torch.randint(lo, hi + 1, (B,), generator=g)]


@pytest.fixture(scope="module")
def pair():
    """A tiny fp64 policy (its greedy continuations fall into cycles) and a draft trained briefly on them (TTT, hard
    labels): good but not perfect, so both accepted paths and rejections occur."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    prompts = ragged_prompts(0, 12, policy.cfg.vocab_size, 2, 5)
    return policy, briefly_trained_draft(policy, prompts, greedy_generate(policy, prompts, 24)).eval()


# ----------------------------------------------------------------------------------- the tree, its mask, the cache
def test_tree_layout():
    t = Tree((2, 2, 1))
    assert (t.k, t.num_nodes, t.level) == (3, 10, [0, 1, 3, 7, 11])
    assert t.parents == (-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6)
    assert t.first_child.tolist() == [1, 3, 5, 7, 8, 9, 10] and t.depth.tolist() == [0, 1, 1] + [2] * 4 + [3] * 4
    for bad in [(), (2, 0), (-1,), (2.5, 1), (True, 2), "21", 3, (32, 32, 2)]:  # (32, 32, 2): 3104 nodes
        with pytest.raises(ValueError, match="tree"):
            Tree(bad)


@pytest.mark.parametrize("form", ["layout", "tuple", "two forwards"])
def test_tree_forward_equals_fresh_forwards(pair, form):
    """A cached tree forward over ragged rows: each node's logits == a fresh forward over prompt + its path; after
    keep_path a plain cached step continues the accepted path exactly. The tree given as a TreeLayout's nodes, as
    (depth, visible, base), or appended in two forwards (the root and depth 1, then depth 2: visible (S, M > S))."""
    policy = pair[0]
    t, V = Tree((2, 3)), policy.cfg.vocab_size
    prompts = ragged_prompts(7, 3, V, 2, 6)
    cache = policy.new_cache(3, 32)
    lens = torch.tensor([len(p) for p in prompts])
    x = torch.zeros(3, int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = p
    policy.forward_cached(x, cache)
    cache.rollback(lens - 1)  # the last prompt token becomes the root
    nodes = torch.randint(V, (3, 1 + t.num_nodes), generator=torch.Generator().manual_seed(1))
    nodes[:, 0] = torch.stack([p[-1] for p in prompts])
    if form == "layout":
        tree = TreeLayout(t.depth, t.visible, lens - 1, cache.max_len).nodes()
        z = policy.forward_cached(nodes, cache, tree=tree).logits
    elif form == "tuple":
        z = policy.forward_cached(nodes, cache, tree=(t.depth, t.visible, lens - 1)).logits
    else:
        parts = [(0, t.level[2]), (t.level[2], 1 + t.num_nodes)]
        z = torch.cat([policy.forward_cached(nodes[:, lo:hi], cache, tree=(t.depth[lo:hi], t.visible[lo:hi, :hi],
                                                                           lens - 1)).logits for lo, hi in parts], 1)
    for b, p in enumerate(prompts):
        for c in range(1 + t.num_nodes):
            anc = [a for a in range(c + 1) if t.visible[c, a]]
            seq = torch.cat([p[:-1], nodes[b, anc]])
            ref = policy(seq, cu_seqlens_from_lengths([len(seq)])).logits[-1]
            assert torch.allclose(z[b, c], ref, atol=1e-10)
    path = torch.tensor([[0, 2, 7], [0, 1, 3], [0, 2, 8]])
    cache.keep_path(lens - 1, path)
    assert cache.lengths.tolist() == (lens + 2).tolist()
    nxt = torch.tensor([[5], [6], [7]])
    z2 = policy.forward_cached(nxt, cache).logits[:, 0]
    for b, p in enumerate(prompts):
        seq = torch.cat([p[:-1], nodes[b, path[b]], nxt[b]])
        assert torch.allclose(z2[b], policy(seq, cu_seqlens_from_lengths([len(seq)])).logits[-1], atol=1e-10)


@pytest.mark.parametrize("tree", [(2, 2, 1), (1, 3, 1), (3, 1, 1, 2)])
def test_draft_tree_levels_equal_chain_steps(pair, tree):
    """The draft's tree forwards (one TreeLayout, one forward per level, each a slice of it) give at every internal
    node exactly the q that the chain's draft steps give along that node's path, ragged rows; the cache is rolled
    back afterwards."""
    policy, draft = pair
    t, tau = Tree(tree), 0.8
    prompts = ragged_prompts(5, 3, policy.cfg.vocab_size, 2, 6)
    s = speculative.prefill(policy, draft, prompts, t.k, tau, None, 16, torch.Generator().manual_seed(0), tree=t)
    cache = s.trunk.cache
    L0 = cache.lengths.clone()
    cand, q = speculative_tree.propose(s, t)
    assert torch.equal(cache.lengths, L0) and q.shape == (3, t.level[t.k], policy.cfg.vocab_size)
    for c in range(t.level[t.k]):
        anc = [a for a in range(1, c + 1) if t.visible[c, a]]  # the node's path below the root
        h, zq = s.trunk.state
        for a in anc:
            h, zq = draft.step(cache, cand[:, a], h)
        cache.rollback(L0)
        assert torch.allclose(q[:, c], torch.softmax(zq / tau, -1), atol=1e-10, rtol=0)


# ------------------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("tree", TREES)
def test_greedy_equals_plain_greedy(pair, tree):
    policy, draft = pair
    prompts = ragged_prompts(1, 5, policy.cfg.vocab_size)
    ref = greedy_generate(policy, prompts, 20)
    r = generate(policy, draft, prompts, max_new_tokens=20, temperature=0, tree=tree)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref]
    assert r.stats.row_steps < r.stats.acceptance_length * r.stats.row_steps < 20 * 5  # accepts and rejects ran
    assert len(r.stats.accept_per_position) == len(tree)


def test_a_chain_as_a_tree_counts_what_the_chain_counts(pair):  # ~1 s
    """tree (1, 1, 1) is the chain k = 3: at tau = 0 the same tokens, and the same per-position acceptance alpha_j and
    per-row counts -- each draft position counted once, among the positions a row keeps."""
    policy, draft = pair
    prompts = ragged_prompts(1, 5, policy.cfg.vocab_size)
    a = generate(policy, draft, prompts, max_new_tokens=20, temperature=0, num_draft_tokens=3)
    b = generate(policy, draft, prompts, max_new_tokens=20, temperature=0, tree=(1, 1, 1))
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    assert a.stats.accept_per_position == b.stats.accept_per_position and a.stats.accept_per_position[1] > 0
    assert (a.stats.row_tried, a.stats.row_accepted) == (b.stats.row_tried, b.stats.row_accepted)


def test_greedy_eos_inside_accepted_path(pair):
    """Ragged rows; EOS is a token of the policy's cycles, so it lands inside accepted paths: each row stops right
    after its first EOS, finished rows leave the batch, the others continue exactly."""
    policy, draft = pair
    prompts = ragged_prompts(2, 6, policy.cfg.vocab_size)
    ref = greedy_generate(policy, prompts, 24)
    eos = int(ref[0][6])
    r = generate(policy, draft, prompts, max_new_tokens=24, temperature=0, eos_id=eos, tree=(2, 2, 1))
    for got, want in zip(r.tokens, ref):
        hit = (want == eos).nonzero()
        assert got.tolist() == (want[: int(hit[0]) + 1] if len(hit) else want).tolist()
    assert any(len(t) < 24 for t in r.tokens) and any(t[-1] == eos and len(t) > 1 for t in r.tokens)
    assert r.stats.acceptance_length > 1.5  # EOS was reached through multi-token accepted paths


@pytest.mark.parametrize("tau,tree", [(1.0, (2, 2, 1)), (0.7, (3, 1)), (0.0, (2, 2))])
def test_logprobs_equal_fresh_forward(pair, tau, tree):
    policy, draft = pair
    prompts = ragged_prompts(4, 4, policy.cfg.vocab_size)
    kw = dict(max_new_tokens=12, temperature=tau, eos_id=5, tree=tree)
    r = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(0), **kw)
    again = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(0), **kw)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in again.tokens]  # seeded: reproducible
    tokens, cu = packed([torch.cat([p, t]) for p, t in zip(prompts, r.tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(policy(tokens, cu).logits / (tau or 1.0), -1)
    for b, (p, t) in enumerate(zip(prompts, r.tokens)):
        assert (t[:-1] != 5).all()  # nothing after the first EOS
        rows = int(cu[b]) + len(p) - 1 + torch.arange(len(t))
        assert torch.allclose(r.logprobs[b], logp[rows, t], atol=1e-9)


def test_bad_input(pair):
    policy, draft = pair
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate(policy, draft, [torch.tensor([1, 2])], max_new_tokens=4, num_draft_tokens=2, tree=(2, 2, 1))
    with pytest.raises(ValueError, match="tree"):
        generate(policy, draft, [torch.tensor([1, 2])], max_new_tokens=4, tree=(2, 0))


# ------------------------------------------------------------------------------- the rule, exactly, and its power
def table(seed, V, zero_frac):
    """A random conditional distribution prefix -> (V,) fp64, some entries exactly 0 (fixed per prefix)."""
    memo = {}

    def f(prefix):
        if prefix not in memo:
            g = torch.Generator().manual_seed(hash((seed,) + prefix) % 2**31)
            w = torch.rand(V, generator=g, dtype=torch.float64) ** 2 * (torch.rand(V, generator=g) >= zero_frac)
            w[int(torch.randint(V, (1,), generator=g))] += 0.05
            memo[prefix] = w / w.sum()
        return memo[prefix]
    return f


def draws(q, b, topk=False):
    """Every ordered draw of b distinct tokens from q without replacement -> [(tokens, probability)]. Once q's
    support is exhausted the remaining picks are the smallest unused ids (the rule must ignore them). topk=True: the
    WRONG candidates, the b most likely tokens with probability 1."""
    if topk:
        return [(tuple(q.topk(b).indices.tolist()), 1.0)]
    out = []
    for xs in itertools.permutations(range(len(q)), b):
        w, left = 1.0, 1.0
        for i, x in enumerate(xs):
            if left <= 1e-15:  # exhausted: the rest is forced
                forced = tuple(v for v in range(len(q)) if v not in xs[:i])[: b - i]
                w = w if xs[i:] == forced else 0.0
                break
            w, left = w * float(q[x]) / left, left - float(q[x])
        if w > 0:
            out.append((xs, w))
    return out


def assignments(tree, Q, topk=False):
    """Every candidate tree: (node tokens (1+N,), path tokens per node, probability)."""
    res = [([0], [()], 1.0)]
    for c in range(tree.level[tree.k]):  # internal nodes in BFS order: their children get tokens
        b = tree.branching[int(tree.depth[c])]
        new = []
        for toks, pre, w in res:
            for xs, wx in draws(Q(pre[c]), b, topk):
                new.append((toks + list(xs), pre + [pre[c] + (x,) for x in xs], w * wx))
        res = new
    return res


def exact_output(tree, P, Q, V, topk=False):
    """The exact distribution of the first k+1 emitted tokens (V,)*(k+1): sum over candidate trees of their
    probability times, over the accept/reject decisions (u below or above each tried node's threshold), the
    probability of that branch; an emitted prefix shorter than k+1 is completed with the true P."""
    k, out = tree.k, torch.zeros((V,) * (tree.k + 1), dtype=torch.float64)

    def complete(toks, w):
        if len(toks) == k + 1:
            out[toks] += w
            return
        for v, pv in enumerate(P(toks).tolist()):
            if pv > 0:
                complete(toks + (v,), w * pv)

    for toks, pre, w in assignments(tree, Q, topk):
        cand = torch.tensor([toks])
        p = torch.stack([P(x) for x in pre])[None]  # (1, 1+N, V)
        q = torch.stack([Q(x) for x in pre[: tree.level[k]]])[None]  # (1, I, V)

        def explore(u, fixed, w):
            path, n, r, a = tree_rule(p, q, cand, u, tree)
            todo = [c for c in range(1 + tree.num_nodes) if not math.isnan(a[0, c]) and c not in fixed]
            if not todo:
                emitted = pre[int(path[0, n[0]])]
                for v, rv in enumerate(r[0].tolist()):
                    if rv > 0:
                        complete(emitted + (v,), w * rv)
                return
            c, ac = todo[0], float(a[0, todo[0]])
            for uc, wc in ((0.0, ac), (1.0, 1.0 - ac)):  # accepted iff u < a: measure a, else 1 - a
                if wc > 0:
                    u2 = u.clone()
                    u2[0, c] = uc
                    explore(u2, fixed | {c}, w * wc)

        explore(torch.ones(1, 1 + tree.num_nodes, dtype=torch.float64), set(), w)
    return out


def exact_policy(P, V, k):
    out = torch.zeros((V,) * (k + 1), dtype=torch.float64)
    for toks in itertools.product(range(V), repeat=k + 1):
        out[toks] = math.prod(float(P(toks[:i])[toks[i]]) for i in range(k + 1))
    return out


CASES = [((1,), 4, 0.0), ((2,), 4, 0.3), ((3,), 4, 0.3), ((4,), 4, 0.5), ((2, 1), 4, 0.3), ((1, 2), 3, 0.0),
         ((2, 2), 3, 0.3)]


@pytest.mark.parametrize("branching,V,zero_frac", CASES)
def test_rule_is_exact(branching, V, zero_frac):
    """Enumerated exactly (fp64): the joint of the first k+1 emitted tokens == the policy's. p and q have zeros
    (tokens the draft cannot propose, and draws past q's support in the (4,) case)."""
    tree, P, Q = Tree(branching), table(1, V, zero_frac), table(2, V, zero_frac)
    got = exact_output(tree, P, Q, V)
    assert torch.allclose(got, exact_policy(P, V, tree.k), atol=1e-12, rtol=0)


@pytest.mark.parametrize("wrong", ["topk candidates", "no residual update", "no draft update"])
def test_exact_test_catches_wrong_rules(wrong, monkeypatch):
    tree, V = Tree((2, 2)), 3
    P, Q = table(3, V, 0.0), table(4, V, 0.0)
    if wrong == "no residual update":
        monkeypatch.setattr(speculative_tree, "_residual", lambda p, q: p)
    if wrong == "no draft update":  # i.e. the with-replacement rule applied to draws without replacement
        monkeypatch.setattr(speculative_tree, "_without", lambda q, x: q)
    got = exact_output(tree, P, Q, V, topk=wrong == "topk candidates")
    assert 0.5 * (got - exact_policy(P, V, tree.k)).abs().sum() > 1e-3


@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 1), (1, 1, 1), (2, 1, 1, 1), (1, 2, 1), (1, 1, 2, 1), (3, 2),
                                       (1, 1, 2), (2, 1, 1, 2, 1)])
def test_batched_rule_equals_naive(branching):
    """Random p, q, candidates and uniforms, 64 rows: the batched rule == the per-row recursion; node c is accepted
    iff u[c] < a[c] (a is the threshold the rule used). Trees with runs of single-child levels (the rule's one-pass
    part) at the top, in the middle and at the bottom, and trees ending on a level with siblings."""
    tree, B, V = Tree(branching), 64, 5
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(B, 1 + tree.num_nodes, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(B, tree.level[tree.k], V, generator=g, dtype=torch.float64), -1)
    sizes = [tree.branching[int(tree.depth[c])] for c in range(tree.level[tree.k])]  # children per internal node
    root = torch.zeros(1, dtype=torch.long)
    cand = torch.stack([torch.cat([root] + [torch.randperm(V, generator=g)[:b] for b in sizes]) for _ in range(B)])
    u = torch.rand(B, 1 + tree.num_nodes, generator=g, dtype=torch.float64)
    path, n, r, a = tree_rule(p, q, cand, u, tree)
    for b in range(B):
        ref_path, ref_r = tree_rule_naive(p[b], q[b], cand[b], u[b], tree)
        assert path[b, 1: 1 + n[b]].tolist() == ref_path and torch.allclose(r[b], ref_r, atol=1e-14)
        tried = ~a[b].isnan()
        assert set(path[b, 1: 1 + n[b]].tolist()) <= set((tried & (u[b] < a[b])).nonzero()[:, 0].tolist())
    assert 0 < n.sum() < B * tree.k  # both outcomes occurred


def test_chain_tree_rule_equals_chain_rule():
    """tree = (1,) * k: same uniforms -> the same accepted count and the same next-token distribution as the chain's
    accept / residual / bonus rule (speculative.verify), so the same samples from one generator."""
    k, B, V = 3, 256, 6
    g = torch.Generator().manual_seed(0)
    zp = 2 * torch.randn(B, k + 1, V, generator=g, dtype=torch.float64)
    q = torch.softmax(2 * torch.randn(B, k, V, generator=g, dtype=torch.float64), -1)
    d = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(B, k)
    n_chain, y_chain = speculative.verify(zp, d, q, 1.0, torch.Generator().manual_seed(5))
    u = torch.rand(B, k, generator=torch.Generator().manual_seed(5)).double()  # what verify drew first
    cand = torch.cat([torch.zeros(B, 1, dtype=torch.long), d], 1)
    path, n, r, _ = tree_rule(torch.softmax(zp, -1), q, cand, torch.cat([torch.ones(B, 1).double(), u], 1),
                              Tree((1,) * k))
    gen = torch.Generator().manual_seed(5)
    torch.rand(B, k, generator=gen)  # advance as verify did
    assert torch.equal(n, n_chain) and 0 < n.sum() < B * k
    assert torch.equal(torch.multinomial(r, 1, generator=gen)[:, 0], y_chain)


# ----------------------------------------------------------------------------------- end to end, statistically
@pytest.fixture(scope="module")
def small_vocab_pair():
    return make_small_vocab_pair()




def tv_first3(pair, tau, tree, N=6000, seed=0):
    """TV(empirical, exact) of the first 3 tokens over N rows, and its bound E[TV] + t: E[TV] <= 1/2 sum_x
    sqrt(p(1-p)/N), P(TV - E[TV] >= t) <= exp(-2 N t^2) (McDiarmid), delta = 1e-6."""
    policy, draft = pair
    prompt, V = torch.tensor([1, 4, 2]), policy.cfg.vocab_size
    p = exact_first3(policy, prompt, tau)
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, temperature=tau, tree=tree,
                 generator=torch.Generator().manual_seed(seed))
    emp = torch.bincount(torch.stack(r.tokens) @ torch.tensor([V * V, V, 1]), minlength=V ** 3).double() / N
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    return 0.5 * (emp.view(V, V, V) - p).abs().sum().item(), bound, r.stats


@pytest.mark.parametrize("tau,tree", [(1.0, (2, 2)), (0.7, (2, 2)), (1.0, (4, 1)), (0.7, (1, 1, 1)), (1.0, (1, 2))])
def test_sampling_matches_exact_distribution(small_vocab_pair, tau, tree):
    tv, bound, st = tv_first3(small_vocab_pair, tau, tree, seed=int(10 * tau) + len(tree))
    assert tv < bound
    assert 1.2 < st.acceptance_length < 2.8  # the mismatch is real: rejections, and multi-token accepted paths


def test_sampling_test_has_power(small_vocab_pair, monkeypatch):
    """Dropping the residual update (resample from p after a rejection) fails the same bound."""
    monkeypatch.setattr(speculative_tree, "_residual", lambda p, q: p)
    tv, bound, _ = tv_first3(small_vocab_pair, 1.0, (2, 2), seed=3)
    assert tv > 2 * bound


def test_config_tree_flag():
    from harness.config import parse_args
    assert parse_args(["--preset", "test", "--tree=2,2,1", "--num_draft_tokens=3"]).tree == (2, 2, 1)
    assert parse_args(["--preset", "test", "--tree=3,1,1,1"]).tree == (3, 1, 1, 1)
    assert parse_args(["--preset", "test", "--tree="]).tree == ()
    with pytest.raises(ValueError, match="num_draft_tokens"):
        parse_args(["--preset", "test", "--tree=2,2"])
    with pytest.raises(ValueError, match="tree"):
        parse_args(["--preset", "test", "--tree=2,0,1"])
    with pytest.raises(ValueError, match="1024 nodes"):  # 32 + 1024 + 2048: refused before any training runs
        parse_args(["--preset", "test", "--tree=32,32,2", "--num_draft_tokens=3"])
    with pytest.raises(ValueError, match="tuple"):
        parse_args(["--preset", "test", "--tree=2,x,1"])


def test_begin_tree_is_loud(pair):
    cache = pair[0].new_cache(2, 8)
    # both are device-side asserts (no host sync per forward): a RuntimeError on CPU
    with pytest.raises(RuntimeError, match="visible"):  # 3 new nodes after base = lengths: the mask needs 3 columns
        cache.begin_tree(torch.zeros(3), torch.ones(3, 4, dtype=torch.bool), cache.lengths)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.begin_tree(torch.zeros(9), torch.eye(9, dtype=torch.bool), cache.lengths)
