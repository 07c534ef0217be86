"""Shared cases for the lossless-sampling tests (chain: test_speculative.py, tree: test_tree.py): a tiny-vocabulary
policy with a deliberately mismatched draft, and the exact distribution of its first three tokens by enumeration."""
import torch

from draft import Eagle3Draft
from model import ModelConfig, Transformer


def make_small_vocab_pair():
    """A 6-token policy with peaked, position-dependent distributions and a deliberately mismatched draft (random
    head, 4 of the 6 tokens only: a (4, ...) tree root exhausts its support)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=6)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() == 2:
                p.mul_(25)
    draft = Eagle3Draft.from_target(policy, draft_vocab=[0, 2, 3, 5], tap_layers=(0, 1))  # the taps it was tuned on
    with torch.no_grad():
        draft.lm_head.weight.normal_(0, 1.0)
    return policy, draft


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
