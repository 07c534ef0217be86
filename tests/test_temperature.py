"""Temperature reaches every log-prob of the update: rollouts sampled at tau = 0.7 store log softmax(z / 0.7), and the
update's new log-probs and the reference's are at the same tau -- so on the rollouts themselves (no optimizer step yet)
the importance ratio pi_theta / pi_old is exactly 1, nothing clips and the k3 drift to an identical reference is 0,
single process (reference_step.cotrain_step) and through the distributed update path (dist_step.DistCotrainer on the
1 x 1 x 1 grid; tests/test_dist_step.py runs the gloo layouts at tau = 0.7 too). Tolerance: fp64 models, the
rollouts' log-probs come from cached incremental forwards: 1e-9.

The drafts' teacher is NOT tempered (rl_loop.py, step 4): every family trains softmax(z_d) on the policy's softmax(z)
at any tau, both paths, watched arms included, and the engine tempers draft and policy alike. So a draft perfect in the
untempered sense (z_d = z: an oracle drafter running the policy itself) accepts every token at tau = 0.7 through
speculative.generate, while one fit to softmax(z / tau), which then samples softmax(z_d / tau) = softmax(z / tau^2),
is capped at sum_x min(p, q) = 0.807 per token on drafter.demo_policy at tau = 0.7 (0.79 at 0.5, 0.934 at 0.9).
Adds ~1.5 s to the suite on a 2-core CPU (the whole file: 2.4 s measured)."""
import copy
from types import SimpleNamespace

import pytest
import torch

import speculative
from branch_mask import cu_seqlens_from_lengths
from decoding.spec_rule import sample
from drafter import demo_policy
from dist_step import DistCotrainer
from draft import Eagle3Draft
from model import EMBED_TAP, ModelConfig, Transformer
from pipeline import Grid
from decoding.k_control import KSchedule
from harness.watch import DraftWatch
from spec_cases import SWITCHING
from reference_step import cotrain_step
from rl_loop import DraftTrainer, GRPOConfig, RolloutBatch, draft_loss, reference_logp, rollout_kl
from test_config_matrix import make_models, sgd
from test_dist_step import make_batch

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


# ------------------------------------------------------------------------------------------- the drafts' teacher
def draft_step(family, path, tau):
    """One co-training step of a fresh fp64 policy and `family`'s draft (a frozen copy watched on the dist paths) at
    rollout temperature tau -> (the draft's loss, its weights after the step, the watched copy's tau_hat)."""
    policy, tr, frozen = make_models(family, "fp32", tied=True)
    batch, cfg = make_batch(policy), grpo(tau)
    if path == "single":
        st = cotrain_step(policy, sgd(policy.parameters()), batch, cfg, [tr])
        watched = None
    else:
        ct = DistCotrainer(policy, [tr], Grid(), sgd, logprob_chunk=7 if path.endswith("fused") else 0,
                           observers=[DraftWatch([frozen], options=tr)])
        st = ct.step(batch, cfg)
        watched = st["observed_metrics"][0]["tau_hat"]
    return st["loss_draft"][0], {k: v.clone() for k, v in tr.draft.state_dict().items()}, watched


@pytest.mark.parametrize("path", ["single", "dist_1x1x1", "dist_1x1x1_fused"])
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_draft_teacher_is_untempered(family, path):
    """At tau = 0.7 every family's draft loss, its update and the watched arm's metrics equal those at tau = 1 on the
    same batch, and the loss is draft_loss against softmax(z) -- not against softmax(z / 0.7), which differs."""
    loss, weights, watched = draft_step(family, path, TAU)
    loss_1, weights_1, watched_1 = draft_step(family, path, 1.0)
    assert loss == pytest.approx(loss_1, abs=1e-12)
    assert all(torch.allclose(weights[k], weights_1[k], rtol=0, atol=1e-12) for k in weights)  # the same update
    assert watched == pytest.approx(watched_1, abs=1e-12)
    policy, tr, _ = make_models(family, "fp32", tied=True)
    batch = make_batch(policy)
    with torch.no_grad():
        out = policy(batch.tokens, batch.cu_seqlens, tap_layers=tr.draft.tap_layers)
        untempered = float(draft_loss(tr, out.taps, out.logits, batch)[0])
        tempered = float(draft_loss(tr, out.taps, out.logits / TAU, batch)[0])
    assert loss == pytest.approx(untempered, abs=1e-9) and abs(untempered - tempered) > 1e-5  # >= 3e-4 here


# ---------------------------------------------------------------------------------- the engine: tempered alike
class OracleDraft:
    """A chain drafter (drafter.py's decoding members) whose logits are the policy's own, scaled: z_d = scale * z.
    scale 1 is the perfect draft of untempered training (softmax(z_d) = softmax(z)); scale 1 / tau the perfect draft
    of a teacher softmax(z / tau). It reads the policy's input embeddings (the embedding tap), recovers the tokens
    and runs the policy itself over them in its own KV cache: a policy cache holding the verified tokens."""
    max_draft_tokens = None
    tap_layers = (EMBED_TAP,)

    def __init__(self, policy, scale: float):
        c = policy.cfg
        self.policy, self.scale = policy, scale
        self.cfg = SimpleNamespace(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                   target_num_layers=c.num_hidden_layers)

    def new_cache(self, batch, max_len, block=None):
        return self.policy.new_cache(batch, max_len, block=block)

    def extend(self, cache, tokens, taps, last):
        """Entry j = (tokens[:, j], e(x_j) at the tapped position j): x_j into the cache, rows keep 0..last; the state
        is the token after the last kept position, not yet in the cache."""
        ids = (taps[EMBED_TAP][..., None, :] == self.policy.embed.weight).all(-1).long().argmax(-1)  # (b, N)
        L0 = cache.lengths.clone()
        self.policy.forward_cached(ids, cache)
        cache.rollback(L0 + last + 1)
        return (tokens[torch.arange(tokens.shape[0]), last],)

    def propose(self, cache, state, k, temperature, generator=None):
        (x,) = state
        L, bound = cache.lengths.clone(), cache.bound
        ds, qs = [], []
        for _ in range(k):  # d_j ~ softmax(z_d / tau), z_d = scale * z(. | x, d_<j)
            z = self.policy.forward_cached(x[:, None], cache).logits[:, -1]
            x, q = sample(self.scale * z, temperature, generator)
            ds.append(x)
            qs.append(q)
        cache.rollback(L, bound=bound)
        return torch.stack(ds, 1), torch.stack(qs, 1)


def oracle_rollout(scale, k, tau=TAU):
    policy = demo_policy().double()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, policy.cfg.vocab_size, (n,), generator=g) for n in (3, 5, 4, 2, 6, 3, 4, 5) * 2]
    with torch.no_grad():
        r = speculative.generate(policy, OracleDraft(policy, scale), prompts, max_new_tokens=64, num_draft_tokens=k,
                                 temperature=tau, generator=torch.Generator().manual_seed(2))
    return policy, prompts, r


def test_untempered_perfect_draft_accepts_every_token():
    """z_d = z, both tempered at tau = 0.7 by the engine: q = p, min(1, p / q) = 1 -- every draft accepted."""
    _, _, r = oracle_rollout(1.0, k=3)
    st = r.stats
    assert st.row_steps > 50 and st.accepted_uncut == 3 * st.row_steps
    assert st.accept_per_position == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("tau, expected", [(0.5, 0.789), (0.7, 0.807), (0.9, 0.934)])
def test_tempered_teacher_caps_acceptance(tau, expected):
    """The control: z_d = z / tau (a perfect fit to softmax(z / tau)) samples softmax(z / tau^2) at tau. Its per-token
    acceptance is sum_x min(p, q) in expectation, p = softmax(z / tau), q = softmax(z / tau^2): 0.807 at tau = 0.7
    averaged over the rollouts' positions, and the engine measures that within sampling noise (k = 1: one draft
    per step, ~550 steps, sd ~0.017; the steps' contexts are not all positions, so a small bias too)."""
    policy, prompts, r = oracle_rollout(1 / tau, k=1, tau=tau)
    seqs = [torch.cat([p, t]) for p, t in zip(prompts, r.tokens)]
    with torch.no_grad():
        z = policy(torch.cat(seqs), cu_seqlens_from_lengths([s.numel() for s in seqs])).logits
    cap = float(torch.minimum(torch.softmax(z / tau, -1), torch.softmax(z / tau ** 2, -1)).sum(-1).mean())
    assert cap == pytest.approx(expected, abs=0.01)
    alpha = r.stats.accepted_uncut / r.stats.row_steps
    assert alpha == pytest.approx(cap, abs=0.05) and alpha < 1 - (1 - cap) / 2  # measured 0.82 at tau = 0.7


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)
