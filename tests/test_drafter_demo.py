"""The family demos teach: `drafter.teach` trains a fresh draft through its family's loss on a confident tiny policy's
own samples, and the predicted acceptance length tau_hat on held-out samples rises (EAGLE-3's TTT and DFlash's
blocks; `python draft.py` is the same at 300 steps). Seeded, so each number is fixed; ~6 s on 2 shared cores.
"""
import pytest
import torch

from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from drafter import demo_policy, demo_proposal, policy_samples, teach

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(steps=60, batch=8, length=24, pool=64, held_out=16, lr=1e-2)


def test_policy_samples_follow_the_policy_and_skip_the_mask():
    """The sharpened policy is confident (its samples are mostly its argmax) and never emits token 0."""
    policy = demo_policy()
    tokens, cu = policy_samples(policy, 8, 24, seed=3)
    assert tokens.shape == (8 * 24,) and cu.tolist() == list(range(0, 8 * 24 + 1, 24)) and (tokens > 0).all()
    with torch.no_grad():
        z = policy(tokens, cu).logits.float()  # (T, V): the policy at each position
    z[:, 0] = -float("inf")
    nxt = torch.arange(tokens.numel()) % 24 != 23  # rows with a next token in their sequence
    top = z.argmax(-1)[nxt] == tokens.roll(-1)[nxt]
    assert top.float().mean() > 0.15  # a flat random policy would pick its argmax ~1/V = 0.01 of the time
    assert torch.equal(tokens, policy_samples(policy, 8, 24, seed=3)[0])  # seeded


def test_ttt_raises_the_predicted_acceptance_length():
    policy = demo_policy()
    draft = Eagle3Draft.from_target(policy)
    before, after = teach(draft, policy, num_passes=3, **SMALL)
    assert after["tau_hat"] > before["tau_hat"] + 0.3, (before["tau_hat"], after["tau_hat"])
    assert all(a > b for a, b in zip(after["alpha"], before["alpha"])), (before["alpha"], after["alpha"])
    assert len(demo_proposal(draft, policy, policy_samples(policy, 1, 9, seed=7)[0], 3)) == 3


def test_a_block_drafter_learns_too():
    policy = demo_policy()
    draft = DFlashDraft.from_target(policy, mask_token_id=0, block_size=4)
    before, after = teach(draft, policy, anchors=4, **SMALL)
    assert after["tau_hat"] > before["tau_hat"] + 0.2, (before["tau_hat"], after["tau_hat"])
