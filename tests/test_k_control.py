"""decoding/k_control.py and decoding/draft_trunk.py: what speculative.generate asks of a k controller, and the
draft's trunk that lets a step draft nothing. The catch-up after k = 0 steps equals extending at every step (fp64,
1e-10); a controller that releases the draft mid-call stops the policy's taps and frees the draft's cache, and the
tokens stay plain greedy decoding's. ~5 s on 2 busy cores."""
import copy

import pytest
import torch

import speculative
from decoding.draft_trunk import DraftTrunk
from decoding.k_control import FixedK, KSchedule
from draft import Eagle3Draft
from model import ModelConfig, Transformer, greedy_generate
from speculative import generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    return policy, Eagle3Draft.from_target(policy).double()


def test_the_catch_up_equals_extending_every_step(pair):
    """Four k = 0 steps (one-token blocks) wait in the trunk, a compaction drops a row in between, and the next
    proposal extends over them in one forward: the same draft state and proposal as a trunk extended at every step."""
    policy, draft = pair
    prompts = [torch.tensor([5, 3, 8]), torch.tensor([1, 2]), torch.tensor([7, 7, 7, 4])]
    with torch.no_grad():
        s = speculative.prefill(policy, draft, prompts, 2, 0.0, None, 10, None)
    lazy, eager = s.trunk, DraftTrunk(draft, copy.deepcopy(s.trunk.cache), s.trunk.state)
    with torch.no_grad():
        for step in range(4):
            if step == 2:  # compaction: row 1 leaves the batch
                keep = torch.tensor([0, 2])
                s.pcache.keep_rows(keep)
                s.y = s.y[keep]
                lazy.keep_rows(keep)
                eager.keep_rows(keep)
            out = policy.forward_cached(s.y[:, None], s.pcache, tap_layers=draft.tap_layers)
            s.y = out.logits[:, 0].argmax(-1)
            n = torch.zeros_like(s.y)
            lazy.extend(s.y[:, None], out.taps, n)
            eager.state = draft.extend(eager.cache, s.y[:, None], out.taps, n)  # what extending every step gives
        assert len(lazy.waiting) == 4
        d, _ = lazy.propose(3, 0.0, None)
        d_ref, _ = eager.propose(3, 0.0, None)
    assert not lazy.waiting and torch.equal(d, d_ref)
    assert torch.equal(lazy.cache.lengths, eager.cache.lengths)
    for a, b in zip(lazy.state, eager.state):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


class _Watch(KSchedule):
    """KSchedule that notes, after each step, whether the draft's trunk still holds a cache and asks for taps."""

    def __init__(self, ks, off_after=None):
        super().__init__(ks, off_after)
        self.seen = []

    def observe(self, s):
        self.seen.append((s.k, s.trunk.cache is not None, s.trunk.tap_layers is not None))


@pytest.mark.parametrize("off_after", [0, 3])
def test_a_released_draft_asks_no_taps_and_frees_its_cache(pair, off_after, monkeypatch):
    """off_after steps with the draft, then the controller releases it: every later step runs k = 0, the policy is
    asked for no taps and the draft's cache is gone; greedy tokens equal plain greedy decoding's throughout."""
    policy, draft = pair
    prompts = [torch.tensor([5, 3, 8]), torch.tensor([1, 2])]
    taps_asked = []
    forward = policy.forward_cached
    monkeypatch.setattr(policy, "forward_cached",
                        lambda x, cache, **kw: (taps_asked.append(kw.get("tap_layers") is not None),
                                                forward(x, cache, **kw))[1])
    ctl = _Watch((2, 0, 1), off_after=off_after)
    r = generate(policy, draft, prompts, max_new_tokens=12, num_draft_tokens=2, temperature=0, adapt=ctl)
    assert [t.tolist() for t in r.tokens] == [t.tolist() for t in greedy_generate(policy, prompts, 12)]
    assert [k for k, _, _ in ctl.seen[:off_after]] == [2, 0, 1][:off_after]
    after = ctl.seen[off_after:]
    assert after and all(step == (0, False, False) for step in after)
    assert taps_asked[0] == (off_after > 0) and not any(taps_asked[1 + off_after:])  # [0]: the prefill


def test_fixed_k_is_the_default_controller(pair):
    """generate(adapt=FixedK(k)) is generate(num_draft_tokens=k): the same tokens and log-probs, sampled."""
    policy, draft = pair
    prompts = [torch.tensor([5, 3, 8]), torch.tensor([1, 2])]
    kw = dict(max_new_tokens=10, num_draft_tokens=3, temperature=1.0)
    a = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(1), **kw)
    b = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(1), adapt=FixedK(3), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens + a.logprobs, b.tokens + b.logprobs))
