"""Temperature reaches every log-prob of the update: rollouts sampled at tau = 0.7 store log softmax(z / 0.7), and the
update's new log-probs, the reference's and the draft's teacher are at the same tau -- so on the rollouts themselves
(no optimizer step yet) the importance ratio pi_theta / pi_old is exactly 1, nothing clips and the k3 drift to an
identical reference is 0, single process (rl_loop.cotrain_step) and through the distributed update path
(dist_step.DistCotrainer on the 1 x 1 x 1 grid; tests/test_dist_step.py runs the gloo layouts at tau = 0.7 too).
Tolerance: fp64 models, the rollouts' log-probs come from cached incremental forwards: 1e-9."""
import copy

import pytest
import torch

import speculative
from dist_step import DistCotrainer
from draft import Eagle3Draft
from model import ModelConfig, Transformer
from pipeline import Grid
from decoding.k_control import KSchedule
from spec_cases import SWITCHING
from rl_loop import DraftTrainer, GRPOConfig, RolloutBatch, cotrain_step, reference_logp, rollout_kl

pytestmark = pytest.mark.usefixtures("one_thread")
TAU = 0.7


def setup(switching=False):
    """switching: the rollout's k switches every step (k = 0 included), as --num_draft_tokens=auto may."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=2)).double()
    draft = Eagle3Draft.from_target(policy)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(policy.cfg.vocab_size, (n,), generator=g) for n in (3, 5, 4, 2, 6, 3)]
    r = speculative.generate(policy, draft, prompts, max_new_tokens=10, num_draft_tokens=3, temperature=TAU,
                             generator=g, adapt=KSchedule(SWITCHING[2][:5]) if switching else None)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    batch = RolloutBatch.from_rollouts(prompts, r.tokens, r.logprobs, adv, torch.ones(6, dtype=torch.bool))
    batch.old_logp = torch.cat([torch.cat([torch.zeros(p.numel(), dtype=torch.float64), lp])  # fp64 (from_rollouts
                                for p, lp in zip(prompts, r.logprobs)])                   # stores fp32)
    batch.adv = batch.adv.double()
    batch.ref_logp = reference_logp(copy.deepcopy(policy), batch, temperature=TAU)
    trainer = DraftTrainer(draft, torch.optim.AdamW(draft.parameters(), lr=1e-3), num_passes=2)
    return policy, trainer, batch


def grpo(tau):
    return GRPOConfig(beta=0.05, temperature=tau)


def opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.mark.parametrize("path", ["single", "dist_1x1x1", "single_k_switching"])
def test_on_policy_ratio_is_one_at_the_rollout_temperature(path):
    policy, trainer, batch = setup(switching=path.endswith("switching"))
    assert rollout_kl(batch) == pytest.approx(0.0, abs=1e-9)  # reference == pi_old at tau
    if path.startswith("single"):
        st = cotrain_step(policy, opt(policy.parameters()), batch, grpo(TAU), [trainer])
    else:
        st = DistCotrainer(policy, [trainer], Grid(), opt).step(batch, grpo(TAU))
    assert st["ratio"] == pytest.approx(1.0, abs=1e-9) and st["clip_frac"] == 0.0
    assert st["k3"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("path", ["single", "dist_1x1x1"])
def test_untempered_log_probs_would_break_the_ratio(path):
    """The test above has power: reading the same rollouts with log_softmax(z) (tau = 1) gives ratios far from 1."""
    policy, trainer, batch = setup()
    if path == "single":
        st = cotrain_step(policy, opt(policy.parameters()), batch, grpo(1.0), [trainer])
    else:
        st = DistCotrainer(policy, [trainer], Grid(), opt).step(batch, grpo(1.0))
    assert abs(st["ratio"] - 1.0) > 1e-3  # mean ratio 1.0065 on this near-uniform random policy, vs 1 +- 1e-9


def test_draft_teacher_is_tempered():
    """The draft's teacher is softmax(z / tau): its TTT loss at tau equals the loss against logits / tau at tau = 1."""
    from rl_loop import draft_loss
    policy, trainer, batch = setup()
    out = policy(batch.tokens, batch.cu_seqlens, tap_layers=trainer.draft.tap_layers)
    a, _ = draft_loss(trainer, out.taps, out.logits, batch, TAU)
    b, _ = draft_loss(trainer, out.taps, out.logits / TAU, batch, 1.0)
    c, _ = draft_loss(trainer, out.taps, out.logits, batch, 1.0)
    a, b, c = (float(x.detach()) for x in (a, b, c))
    assert a == pytest.approx(b, abs=1e-12) and abs(a - c) > 1e-4


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)
