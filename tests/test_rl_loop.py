"""GRPO math against hand-computed values, and the co-training step's gradient isolation."""
import math

import pytest
import torch

from model import ModelConfig, Transformer
from modeling.layers import packed_causal_attention
from rl_loop import (DraftTrainer, GRPOConfig, RolloutBatch, aggregate, clipped_surrogate, group_advantages, k3,
                     next_token_logp, pack, rollout_kl)
from reference_step import cotrain_step, policy_loss
from backends.attention_padded import padded_branch_attention, padded_causal_attention


# ---------------------------------------------------------------------------------------------------- advantages
def test_group_advantages_std_normalised_and_dr_grpo():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 2 has no variance
    A, valid = group_advantages(r, 4, std_norm=True, eps=0.0)
    assert torch.allclose(A, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))
    assert valid.tolist() == [True] * 4 + [False] * 4
    A, valid = group_advantages(r, 4, std_norm=False)  # Dr. GRPO: r - mean, no std
    assert torch.allclose(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    A, _ = group_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.0)  # std sqrt(2): A = +-1/sqrt(2)
    assert torch.allclose(A, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_group_advantages_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 1)


# ---------------------------------------------------------------------------------------------- surrogate and k3
def test_clipped_surrogate_asymmetric_clip():
    rho = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    loss, clipped = clipped_surrogate(rho.log(), torch.zeros(5), adv, eps_low=0.2, eps_high=0.28)
    # A>0, rho>1+eps_high: min(1.5, 1.28) -> clipped;   A<0, rho large: min(-1.5, -1.28) = -1.5 (pessimistic, no clip)
    # A>0, rho<1-eps_low: min(0.5, 0.8) = 0.5;           A<0, rho small: min(-0.5, -0.8) = -0.8 -> clipped
    assert torch.allclose(loss, torch.tensor([-1.28, 1.5, -0.5, 0.8, -2.2]))
    assert clipped.tolist() == [True, False, False, True, False]


def test_k3_values():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    # ratio = pi_ref / pi: 0.5 -> 0.5 - 1 + log 2;  2 -> 2 - 1 - log 2;  1 -> 0
    assert torch.allclose(k3(logp, ref), torch.tensor([-0.5 + math.log(2), 1 - math.log(2), 0.0]))


# ------------------------------------------------------------------------------------------------- aggregation
def _agg_case():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    loss = torch.tensor([0.0, 1, 2, 0, 3, 4, 5])
    mask = torch.tensor([False, True, True, False, True, True, True])  # seq 0: {1, 2}; seq 1: {3, 4, 5}
    return loss, mask, cu


@pytest.mark.parametrize("norm, kw, expected", [
    ("seq-mean", dict(n_seqs=2), (3 / 2 + 12 / 3) / 2),  # 2.75
    ("token-mean", dict(), 15 / 5),
    ("token-mean", dict(n_micro=2), 15 / 5 / 2),
    ("global-token", dict(n_tokens=10), 15 / 10),  # the other micro-batch holds 5 more tokens
    ("constant", dict(n_seqs=2, max_len=10), 15 / (2 * 10)),  # Dr. GRPO
])
def test_aggregate_hand_values(norm, kw, expected):
    loss, mask, cu = _agg_case()
    args = dict(n_seqs=1, n_tokens=1, max_len=1, n_micro=1)
    args.update(kw)
    assert float(aggregate(loss, mask, cu, norm, **args)) == pytest.approx(expected)


def test_aggregate_micro_batches_sum_to_the_full_batch_except_token_mean():
    torch.manual_seed(0)
    lens = [3, 6, 2, 5]
    tokens, cu = pack([torch.zeros(n, dtype=torch.long) for n in lens])
    loss = torch.randn(tokens.numel())
    mask = torch.rand(tokens.numel()) > 0.3
    mask[cu[:-1].long()] = True  # every sequence keeps >= 1 token
    n_tok = int(mask.sum())
    for norm in ("seq-mean", "global-token", "constant", "token-mean"):
        kw = dict(n_seqs=4, n_tokens=n_tok, max_len=7)
        full = aggregate(loss, mask, cu, norm, **kw)
        a, b = int(cu[2]), int(cu[4])  # micro-batches: sequences {0, 1} and {2, 3}
        parts = (aggregate(loss[:a], mask[:a], cu[:3], norm, n_micro=2, **kw)
                 + aggregate(loss[a:b], mask[a:b], cu[2:] - cu[2], norm, n_micro=2, **kw))
        if norm == "token-mean":  # per-micro-batch means weight tokens unequally: the bias DAPO's global count removes
            assert not torch.allclose(full, parts)
        else:
            assert torch.allclose(full, parts)


def test_aggregate_rejects_unknown_norm():
    loss, mask, cu = _agg_case()
    with pytest.raises(ValueError, match="loss_norm"):
        aggregate(loss, mask, cu, "mean", n_seqs=1, n_tokens=1, max_len=1)
    with pytest.raises(ValueError, match="loss_norm"):
        GRPOConfig(loss_norm="sum")


# ------------------------------------------------------------------------------------------ batches and the loss
def _batch(adv=(1.0, -1.0), valid=(True, True)):
    prompts = [torch.tensor([1, 2]), torch.tensor([3])]
    responses = [torch.tensor([4, 5, 6]), torch.tensor([7, 8])]
    logp = [torch.log(torch.tensor([0.5, 0.5, 0.5])), torch.log(torch.tensor([0.25, 0.25]))]
    return RolloutBatch.from_rollouts(prompts, responses, logp, torch.tensor(adv), torch.tensor(valid))


def test_rollout_batch_layout_and_select():
    b = _batch()
    assert b.tokens.tolist() == [1, 2, 4, 5, 6, 3, 7, 8]
    assert b.cu_seqlens.tolist() == [0, 5, 8]
    assert b.resp_mask.tolist() == [False, False, True, True, True, False, True, True]
    s = b.select([1])
    assert s.tokens.tolist() == [3, 7, 8] and s.cu_seqlens.tolist() == [0, 3]
    assert torch.allclose(s.old_logp, torch.tensor([0.0, math.log(0.25), math.log(0.25)]))
    assert s.adv.tolist() == [-1.0]
    assert b.to("cpu") is b  # already there: no copy
    m = b.to("meta")  # every tensor moves (meta: a device without data, available on any machine)
    assert all(getattr(m, k).device.type == "meta" and getattr(m, k).shape == getattr(b, k).shape
               for k in ("tokens", "cu_seqlens", "resp_mask", "old_logp", "adv", "valid")) and m.ref_logp is None


def test_policy_loss_hand_value_with_k3_and_skipped_group():
    b = _batch(adv=(1.0, 2.0), valid=(True, False))  # group of seq 1 had zero variance: skipped
    b.ref_logp = b.old_logp.clone()
    b.ref_logp[2] = math.log(0.25)
    logp = b.old_logp.clone()
    logp[3] = math.log(0.75)  # rho = 1.5 -> clipped at 1.28
    logp[6] = math.log(0.99)  # inside the skipped sequence: must not matter
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.28, beta=0.1, loss_norm="global-token")
    loss, st = policy_loss(logp, b, cfg, n_seqs=1, n_tokens=3)
    k3_2 = 0.5 - 1 + math.log(2)  # ratio = pi_ref / pi = 0.25 / 0.5 at token 2
    k3_3 = 2 / 3 - 1 - math.log(2 / 3)  # ratio = 0.5 / 0.75 at token 3
    expected = (-1.0 + 0.1 * k3_2 - 1.28 + 0.1 * k3_3 - 1.0) / 3
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert st["tokens"] == 3 and st["clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="ref_logp"):
        b.ref_logp = None
        policy_loss(logp, b, cfg, n_seqs=1, n_tokens=3)


def test_rollout_kl_is_mean_k3_over_responses():
    b = _batch()
    b.ref_logp = b.old_logp + torch.tensor([0, 0, 0.1, 0.1, 0.1, 0, -0.2, -0.2])
    want = (3 * (math.exp(0.1) - 1 - 0.1) + 2 * (math.exp(-0.2) - 1 + 0.2)) / 5
    assert rollout_kl(b) == pytest.approx(want, rel=1e-5)


def test_next_token_logp_matches_log_softmax():
    torch.manual_seed(0)
    tokens, cu = pack([torch.randint(11, (4,)), torch.randint(11, (3,))])
    logits = torch.randn(7, 11)
    lp = next_token_logp(logits, tokens, cu)
    ref = torch.log_softmax(logits, -1)
    want = [0.0] + [float(ref[t - 1, tokens[t]]) for t in range(1, 7)]
    want[4] = 0.0  # the start of sequence 2
    assert torch.allclose(lp, torch.tensor(want), atol=1e-6)


def test_padded_attention_matches_packed_reference_forward_and_backward():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8, requires_grad=True)
    k = torch.randn(16, 2, 8, requires_grad=True)
    v = torch.randn(16, 2, 8, requires_grad=True)
    g = torch.randn(16, 4, 8)
    outs = []
    for fn in (packed_causal_attention, padded_causal_attention):
        o = fn(q, k, v, cu, 0.3)
        grads = torch.autograd.grad((o * g).sum(), (q, k, v))
        outs.append((o, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ co-training step
def _policy_draft(seed=0):
    from draft import Eagle3Draft
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=17))
    draft = Eagle3Draft.from_target(policy)
    return policy, draft


def _random_batch(n_prompts=2, G=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses, logps = [], [], []
    for i in range(n_prompts * G):
        prompts.append(torch.randint(3, 17, (4,), generator=g))
        n = int(torch.randint(3, 7, (1,), generator=g))
        responses.append(torch.randint(3, 17, (n,), generator=g))
        logps.append(-torch.rand(n, generator=g) * 3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])[: n_prompts * G]  # 2nd group: zero variance
    A, valid = group_advantages(rewards, G)
    return RolloutBatch.from_rollouts(prompts, responses, logps, A, valid)


def test_losses_are_isolated_policy_gets_nothing_from_draft_and_vice_versa():
    from rl_loop import draft_loss
    policy, draft = _policy_draft()
    tr = DraftTrainer(draft, torch.optim.SGD(draft.parameters(), lr=0.0))
    b = _random_batch()
    out = policy(b.tokens, b.cu_seqlens, tap_layers=draft.tap_layers)
    logp = next_token_logp(out.logits, b.tokens, b.cu_seqlens)
    L_p, _ = policy_loss(logp, b, GRPOConfig(), n_seqs=3, n_tokens=int(b.trained_mask().sum()))
    L_d, _ = draft_loss(tr, out.taps, out.logits, b)
    # d L_draft / d policy = 0: autograd finds no path (allow_unused returns None for every policy parameter)
    assert all(g is None for g in torch.autograd.grad(L_d, list(policy.parameters()), retain_graph=True,
                                                       allow_unused=True))
    assert all(g is None for g in torch.autograd.grad(L_p, list(draft.parameters()), retain_graph=True,
                                                       allow_unused=True))
    # ... while each loss does reach its own model
    assert any(g is not None and g.abs().sum() > 0 for g in torch.autograd.grad(L_d, list(draft.parameters()),
                                                                                retain_graph=True, allow_unused=True))
    assert any(g is not None and g.abs().sum() > 0 for g in torch.autograd.grad(L_p, list(policy.parameters()),
                                                                                allow_unused=True))


def test_cotrain_step_one_policy_forward_per_micro_batch_and_gradients_equal_the_separate_losses():
    from rl_loop import draft_loss
    policy, draft = _policy_draft(1)
    b = _random_batch(seed=1)
    cfg = GRPOConfig(loss_norm="global-token")
    n_seqs, n_tok = int(b.valid.sum()), int(b.trained_mask().sum())
    # reference gradients: full batch, each loss on its own
    out = policy(b.tokens, b.cu_seqlens, tap_layers=draft.tap_layers)
    L_p, _ = policy_loss(next_token_logp(out.logits, b.tokens, b.cu_seqlens), b, cfg, n_seqs=n_seqs, n_tokens=n_tok)
    tr = DraftTrainer(draft, torch.optim.SGD(draft.parameters(), lr=1.0), lam=0.5, grad_clip=1e9)
    L_d, _ = draft_loss(tr, out.taps, out.logits, b)
    gp = torch.autograd.grad(L_p, list(policy.parameters()), allow_unused=True)
    gd = torch.autograd.grad(0.5 * L_d, list(draft.parameters()), allow_unused=True)
    calls = []
    handle = policy.register_forward_hook(lambda *a: calls.append(1))
    p0 = [p.detach().clone() for p in policy.parameters()]
    d0 = [p.detach().clone() for p in draft.parameters()]
    st = cotrain_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), b, cfg, [tr], micro_batches=1,
                      policy_grad_clip=1e9)
    handle.remove()
    assert len(calls) == 1  # ONE policy forward feeds both losses
    for p, before, g in zip(policy.parameters(), p0, gp):  # SGD lr=1: the step IS minus the gradient
        torch.testing.assert_close(before - p.detach(), torch.zeros_like(p) if g is None else g, atol=1e-6, rtol=1e-5)
    for p, before, g in zip(draft.parameters(), d0, gd):
        torch.testing.assert_close(before - p.detach(), torch.zeros_like(p) if g is None else g, atol=1e-6, rtol=1e-5)
    assert st["loss_total"] == pytest.approx(L_p.item() + 0.5 * L_d.item(), rel=1e-5)


def test_cotrain_micro_batches_match_one_batch_for_global_token_norm():
    b = _random_batch(seed=2)
    cfg = GRPOConfig(loss_norm="global-token", beta=0.05)
    b.ref_logp = b.old_logp - 0.1
    params = []
    for micro in (1, 3):
        policy, draft = _policy_draft(2)
        tr = DraftTrainer(draft, torch.optim.SGD(draft.parameters(), lr=1.0), grad_clip=1e9)
        calls = []
        policy.register_forward_hook(lambda *a: calls.append(1))
        cotrain_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), b, cfg, [tr], micro_batches=micro,
                     policy_grad_clip=1e9, attn_fn=padded_causal_attention)
        assert len(calls) == micro
        params.append([p.detach().clone() for p in policy.parameters()])
    for a, c in zip(*params):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_padded_branch_attention_matches_the_dense_oracle_forward_and_backward():
    from attention_cp import reference_branch_attention

    def oracle(q, k, v, cu, bk, bv, softmax_scale):
        return reference_branch_attention(q, k, v, cu, bk, bv, softmax_scale=softmax_scale)[0]

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    for P in (0, 2):
        q = torch.randn(16, 4, 8, requires_grad=True)
        kv = [torch.randn(16, 2, 8, requires_grad=True) for _ in range(2)]
        br = [torch.randn(16, P, 2, 8, requires_grad=True) for _ in range(2)] if P else [None, None]
        g = torch.randn(16, 4, 8)
        res = []
        for fn in (oracle, padded_branch_attention):
            o = fn(q, *kv, cu, *br, softmax_scale=0.3)
            leaves = [q, *kv] + ([*br] if P else [])
            res.append((o, torch.autograd.grad((o * g).sum(), leaves)))
        torch.testing.assert_close(res[0][0], res[1][0], atol=1e-5, rtol=1e-5)
        for a, b in zip(res[0][1], res[1][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
