"""Shared cases for the lossless-sampling tests (chain: test_speculative.py, tree: test_tree.py): a tiny-vocabulary
policy with a deliberately mismatched draft, the exact distribution of its first three tokens by enumeration, and a
draft trained briefly on a policy's own continuations (test_tree.py, test_eos_ids.py)."""
import torch

from draft import Eagle3Draft
from model import ModelConfig, Transformer


def peaked_policy():
    """A 6-token policy with peaked, position-dependent distributions (seed 0; its matrices scaled by 25)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=6)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() == 2:
                p.mul_(25)
    return policy


def make_small_vocab_pair():
    """peaked_policy and a deliberately mismatched draft (random head, 4 of the 6 tokens only: a (4, ...) tree root
    exhausts its support)."""
    policy = peaked_policy()
    draft = Eagle3Draft.from_target(policy, draft_vocab=[0, 2, 3, 5], tap_layers=(0, 1))  # the taps it was tuned on
    with torch.no_grad():
        draft.lm_head.weight.normal_(0, 1.0)
    return policy, draft


def briefly_trained_draft(policy, prompts, continuations):
    """An EAGLE-3 draft trained 30 TTT steps (hard labels, 2 passes) on prompt + continuation sequences of `policy`:
    good but not perfect, so both accepted paths and rejections occur."""
    from branch_mask import cu_seqlens_from_lengths
    seqs = [torch.cat([p, o]) for p, o in zip(prompts, continuations)]
    tokens, cu = torch.cat(seqs), cu_seqlens_from_lengths([len(s) for s in seqs])
    draft = Eagle3Draft.from_target(policy)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(30):
        loss, _ = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=2, hard_labels=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft


def exact_first3(policy, prompt, tau):
    """P(x1 x2 x3 | prompt) at temperature tau for every continuation, by enumeration: (V, V, V)."""
    V = policy.cfg.vocab_size
    x12 = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V^2, 2)
    seqs = torch.cat([prompt.expand(V * V, -1), x12], 1)  # (V^2, L+2)
    with torch.no_grad():
        z = policy(seqs.flatten(), torch.arange(0, seqs.numel() + 1, seqs.shape[1], dtype=torch.int32)).logits
    p = torch.softmax(z.view(V * V, -1, V)[:, -3:].double() / tau, -1)  # (V^2, 3, V)
    p1, p2, p3 = p[0, 0], p[::V, 1], p[:, 2].view(V, V, V)  # p2 (V, V) rows x1
    return p1[:, None, None] * p2[:, :, None] * p3


# k switching mid-generation (speculative.generate(adapt=...)): each cycle holds k = 0 steps (autoregressive, the draft
# trunk catching up later) between chain steps, so every transition 0 -> k, k -> 0 and k -> k' runs
SWITCHING = [(0, 2), (2, 0), (3, 0, 0, 1, 2, 0, 4)]
