"""draft.py: construction from a policy, TTT == inference, the TTT loss == a naive per-anchor loop, the ring attention
path == the dense-mask oracle, CP (threads and gloo) == no CP for loss, metrics and grads, checkpoints, errors."""
import copy
import math

import pytest
import torch

from attention_cp import reference_branch_attention
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard
from parallel.ring import run_ranks
from dist_util import run_distributed
from draft import DraftConfig, Eagle3Draft
from model import EMBED_TAP, ModelConfig, Transformer, default_tap_layers

LENS = [7, 4, 9, 2]  # odd lengths: exercises the padding to the zigzag layout's even lengths


pytestmark = pytest.mark.usefixtures("one_thread")


def case(draft_vocab=None, lens=LENS, layers=8):
    """fp64 policy (8 layers: three distinct taps), its draft with sharpened weights, a packed batch and its taps."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=layers)).double().eval()
    draft = Eagle3Draft.from_target(policy, draft_vocab=draft_vocab)
    with torch.no_grad():  # sharper attention / MLP than the 0.02 init, so every term of the layer matters
        for n, p in draft.named_parameters():
            if p.dim() == 2 and n != "lm_head.weight":
                p.mul_(8)
    cu = cu_seqlens_from_lengths(lens)
    tokens = torch.randint(policy.cfg.vocab_size, (int(cu[-1]),), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    return policy, draft, tokens, cu, out


def test_from_target_structure():
    policy, draft, tokens, cu, out = case()
    H, n = policy.cfg.hidden_size, policy.cfg.num_hidden_layers
    assert draft.tap_layers == default_tap_layers(n) == (1, 3, 4)
    assert draft.fc.weight.shape == (H, 3 * H)
    assert draft.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H  # attention reads [e; h]
    assert torch.equal(draft.lm_head.weight, policy.lm_head.weight)  # unscaled: initialised from the policy's head
    assert Eagle3Draft.from_target(policy, tap_layers=(0, 7)).fc.weight.shape == (H, 2 * H)
    with pytest.raises(ValueError, match="tap_layers"):
        Eagle3Draft.from_target(policy, tap_layers=(EMBED_TAP, 2))
    with pytest.raises(ValueError, match="tap_layers"):
        Eagle3Draft.from_target(policy, tap_layers=(1, 8))
    with pytest.raises(ValueError, match="draft_vocab"):
        Eagle3Draft.from_target(policy, draft_vocab=[3, 3])
    # the embedding is shared (in-place policy updates show through) and frozen (no draft gradient reaches it)
    assert "embed_weight" not in draft.state_dict() and all(p is not policy.embed.weight for p in draft.parameters())
    loss, _ = draft.ttt_loss(out.taps, tokens, cu, out.logits)
    loss.backward()
    assert policy.embed.weight.grad is None and draft.fc.weight.grad is not None
    with torch.no_grad():
        policy.embed.weight[5] += 1.0
    assert torch.equal(draft.embed(torch.tensor([5])), policy.embed(torch.tensor([5])))


def test_reduced_vocabulary_map():
    ids = torch.tensor([2, 3, 11, 40, 96])
    policy, draft, *_ = case(draft_vocab=ids[torch.randperm(5)])
    assert torch.equal(draft.draft_to_target, ids) and int(draft.t2d.sum()) == 5 and bool(draft.t2d[ids].all())
    assert torch.equal(draft.lm_head.weight, policy.lm_head.weight[ids])
    z = draft.target_logits(torch.randn(3, policy.cfg.hidden_size, dtype=torch.float64))
    assert bool(torch.isinf(z[:, ~draft.t2d]).all()) and bool(draft.t2d[z.argmax(-1)].all())


def test_ttt_equals_inference():
    """Pass d at anchor i in training == the draft at inference: extend the trunk up to anchor i (its own KV cache),
    then d-1 steps fed the same tokens x_{i+2}, ..., x_{i+d}."""
    P = 4
    policy, draft, tokens, cu, out = case()
    with torch.no_grad():
        logits = [draft.logits(h) for h in draft.ttt_forward(out.taps, tokens, cu, P)]  # P x (T, V)
    rows = [(s, i) for s, L in enumerate(LENS) for i in range(L - 1)]  # anchors with a next token
    N = max(LENS) - 1
    B = len(rows)
    nxt = torch.zeros(B, N, dtype=torch.long)
    taps = {l: torch.zeros(B, N, policy.cfg.hidden_size, dtype=torch.float64) for l in draft.tap_layers}
    for b, (s, _) in enumerate(rows):
        a, L = int(cu[s]), LENS[s]
        nxt[b, : L - 1] = tokens[a + 1: a + L]  # entry j = (x_{j+1}, taps at j)
        for l in taps:
            taps[l][b, : L - 1] = out.taps[l][a: a + L - 1]
    cache = draft.new_cache(B, N + P)
    with torch.no_grad():
        h, z = draft.extend(cache, nxt, taps, torch.tensor([i for _, i in rows]))
        checked = 0
        for d in range(1, P + 1):
            if d > 1:
                x = torch.tensor([int(tokens[int(cu[s]) + min(i + d, LENS[s] - 1)]) for s, i in rows])
                h, z = draft.step(cache, x, h)
            for b, (s, i) in enumerate(rows):
                if i + d <= LENS[s] - 1:  # the input token x_{i+d} exists
                    torch.testing.assert_close(z[b], logits[d - 1][int(cu[s]) + i], rtol=0, atol=1e-10)
                    checked += 1
    assert checked == sum(max(L - d, 0) for L in LENS for d in range(1, P + 1))


@pytest.mark.parametrize("hard,vocab", [(False, None), (True, None), (False, "reduced"), (True, "reduced")])
def test_ttt_loss_equals_naive(hard, vocab):
    """L = sum_d 0.8^(d-1) mean_{i: x_{i+d+1} exists} CE(teacher at i+d, q^d_i), spelled out anchor by anchor."""
    P = 3
    ids = torch.arange(0, 97, 2) if vocab else None  # even ids only: hard labels on odd ids are masked
    policy, draft, tokens, cu, out = case(draft_vocab=ids)
    loss, m = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=P, hard_labels=hard)
    with torch.no_grad():
        q = [torch.log_softmax(draft.logits(h), -1) for h in draft.ttt_forward(out.taps, tokens, cu, P)]
    keep = torch.arange(97) if ids is None else ids
    total, acc1 = 0.0, []
    for d in range(1, P + 1):
        ces = []
        for s, L in enumerate(LENS):
            for i in range(L - d - 1):  # i + d + 1 <= L - 1
                a = int(cu[s]) + i
                if hard:
                    y = int(tokens[a + d + 1])
                    if y in keep.tolist():
                        ces.append(-q[d - 1][a, keep.tolist().index(y)])
                else:
                    p = torch.softmax(out.logits[a + d, keep], -1)
                    ces.append(-(p * q[d - 1][a]).sum())
                if d == 1 and not hard:
                    acc1.append(float(keep[q[0][a].argmax()] == out.logits[a + 1].argmax()))
        assert m["count"][d - 1] == len(ces)
        total += 0.8 ** (d - 1) * torch.stack(ces).mean()
    torch.testing.assert_close(loss.detach(), total, rtol=1e-12, atol=1e-12)
    if not hard:
        assert m["acc"][0] == pytest.approx(sum(acc1) / len(acc1))
    assert m["tau_hat"] == pytest.approx(1 + sum(math.prod(m["alpha"][:j + 1]) for j in range(P)))
    assert all(0 <= a <= 1 for a in m["alpha"] + m["acc"] + m["acc_cond"])


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_ring_attention_path_equals_dense_oracle():
    policy, draft, tokens, cu, out = case()
    dense = copy.deepcopy(draft)

    def oracle(q, k, v, cu_seqlens, bk, bv, *, group=None, softmax_scale=None, backend=None):
        return reference_branch_attention(q, k, v, cu_seqlens, bk, bv, softmax_scale)[0]

    loss, _ = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=4)
    ref, _ = dense.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=4, attn_fn=oracle)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    g, gr = grads(draft), grads(dense)
    assert g.keys() == gr.keys() and len(g) > 10
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------------------------------ context parallelism
CP_LENS = [13, 4, 21]


def cp_reference(hard=False):
    """cp = 1 on the unpadded batch: loss, metrics, grads."""
    policy, draft, tokens, cu, out = case(lens=CP_LENS)
    loss, m = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=3, hard_labels=hard)
    loss.backward()
    return loss.item(), m, grads(draft)


def cp_rank(rank, cp, group, hard=False, built=None):
    """This rank's share: pad for cp, zigzag-shard every per-token input, run the same loss under CP."""
    policy, draft, tokens, cu, out = built or case(lens=CP_LENS)
    pad = pad_for_cp(cu, cp)
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)  # position j predicts x_{j+1}: false at each sequence's end
    mask[:] = True
    mask[(cu[1:] - 1).long()] = False
    shard = lambda x, fill=0: zigzag_shard(pad.pad(x, fill), pad.cu_seqlens, cp, rank)  # noqa: E731
    loss, m = draft.ttt_loss({l: shard(t) for l, t in out.taps.items()}, shard(tokens), pad.cu_seqlens,
                             shard(out.logits), loss_mask=shard(mask, False), num_passes=3, hard_labels=hard,
                             group=group)
    loss.backward()
    return loss.item(), m, grads(draft)


def assert_cp_matches(results, ref):
    loss, m, g = ref
    assert sum(r[0] for r in results) == pytest.approx(loss, rel=1e-12)  # rank shares sum to the global loss
    for r in results:
        for key in ("loss_per_pass", "acc", "acc_cond", "alpha", "count"):
            assert r[1][key] == pytest.approx(m[key], rel=1e-12)
    for n in g:  # the draft's grads summed over the CP group (what the DP/CP all-reduce does)
        torch.testing.assert_close(sum(r[2][n] for r in results), g[n], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cp,hard", [(2, False), (3, True), (4, False)])
def test_cp_threads_equal_cp1(cp, hard):
    """The real per-rank code, ranks as threads over an in-process ring (fast)."""
    built = case(lens=CP_LENS)  # built once: threads share the global RNG, so each rank gets a copy
    ranks = run_ranks(cp, lambda ring: cp_rank(ring.rank, cp, ring, hard, built=copy.deepcopy(built)), timeout=60)
    assert_cp_matches(ranks, cp_reference(hard))


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_embedding_tap_equals_embedding_lookup(cp):
    """The update path's inputs: e(x_{i+d}) read from the policy's embedding tap (shifted, under CP across ranks)
    instead of looked up in the draft's shared embedding, which is NaN here so that a read would show. Loss, metrics
    and grads equal the lookup path at cp = 1 (fp64)."""
    policy, draft, tokens, cu, out = case(lens=CP_LENS)
    with torch.no_grad():
        out.taps[EMBED_TAP] = policy.embed(tokens)  # (T, H) what stage 0's forward taps
    draft.register_buffer("embed_weight", torch.full_like(draft.embed_weight, float("nan")), persistent=False)
    built = (policy, draft, tokens, cu, out)
    ranks = run_ranks(cp, lambda ring: cp_rank(ring.rank, cp, ring, built=copy.deepcopy(built)), timeout=60)
    assert_cp_matches(ranks, cp_reference())


def _gloo_worker(rank, world_size):
    import torch.distributed as dist
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    runs = {"cp3": cp_rank(rank, 3, dist.group.WORLD)}
    if rank < 2:
        runs["cp2"] = cp_rank(rank, 2, pair)
    # plain Python back to the parent: tensors would travel as shared memory that dies with this process
    return {key: (loss, m, {n: (g.tolist(), g.dtype) for n, g in gr.items()}) for key, (loss, m, gr) in runs.items()}


def test_cp_gloo_equals_cp1():
    """cp = 3 over 3 real gloo processes and cp = 2 over a subgroup of two of them, both == cp = 1."""
    res = run_distributed(_gloo_worker, 3, timeout=90)
    back = lambda r: (r[0], r[1], {n: torch.tensor(g, dtype=dt) for n, (g, dt) in r[2].items()})  # noqa: E731
    ref = cp_reference()
    assert_cp_matches([back(r["cp3"]) for r in res], ref)
    assert_cp_matches([back(r["cp2"]) for r in res[:2]], ref)


# --------------------------------------------------------------------------------------------- checkpoints, errors
def test_save_load_roundtrip(tmp_path):
    policy, draft, tokens, cu, out = case(draft_vocab=torch.arange(10, 60))
    draft.save(str(tmp_path / "d"))
    back = Eagle3Draft.load(str(tmp_path / "d"), policy)
    assert back.cfg == draft.cfg and back.embed_weight.data_ptr() == policy.embed.weight.data_ptr()
    with torch.no_grad():
        for a, b in zip(draft.ttt_forward(out.taps, tokens, cu, 2), back.ttt_forward(out.taps, tokens, cu, 2)):
            assert torch.equal(draft.target_logits(a), back.target_logits(b))
    with pytest.raises(ValueError, match="path"):
        Eagle3Draft.load(str(tmp_path / "nothing"), policy)
    with pytest.raises(ValueError, match="embed"):
        Eagle3Draft.load(str(tmp_path / "d"), torch.zeros(5, 5))


def test_bad_input():
    policy, draft, tokens, cu, out = case()
    with pytest.raises(ValueError, match="taps"):
        draft.ttt_loss({1: out.taps[1]}, tokens, cu, out.logits)
    with pytest.raises(ValueError, match="teacher_logits"):
        draft.ttt_loss(out.taps, tokens, cu, out.logits[:, :50])
    with pytest.raises(ValueError, match="num_passes"):
        draft.ttt_forward(out.taps, tokens, cu, 0)
    with pytest.raises(ValueError, match="loss_mask"):
        draft.ttt_loss(out.taps, tokens, cu, out.logits, loss_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, tap_layers=(0,), target_num_layers=2, draft_vocab_size=11)
