"""The co-training claim's measuring pieces: the paired bootstrap interval (eval_arms.paired_bootstrap) against a naive
loop over the same resamples, the offline-extended control arm (offline_arm.OfflineArm: fresh pi_0 samples every
step, as many optimizer steps as the co-trained arm, the reference untouched), the end-to-end step-time arithmetic
(report.e2e_step_times) by hand, and where the drafts' optimizers live (the training stage only; ~1 s)."""
import copy

import pytest
import torch

from tasks import task
from harness.config import PRESETS, Config
from draft import Eagle3Draft
from harness.eval_arms import paired_bootstrap
from model import ModelConfig, Transformer
from harness.offline_arm import OfflineArm
from harness.report import e2e_step_times

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_bootstrap(ka, fa, kb, fb, group, n, seed):
    P = len(ka) // group
    unit = lambda x: [sum(x[p * group:(p + 1) * group]) for p in range(P)]  # noqa: E731
    ka, fa, kb, fb = map(unit, (ka, fa, kb, fb))
    idx = torch.randint(P, (n, P), generator=torch.Generator().manual_seed(seed)).tolist()
    diff = sorted(sum(ka[i] for i in r) / sum(fa[i] for i in r) - sum(kb[i] for i in r) / sum(fb[i] for i in r)
                  for r in idx)
    q = lambda p: float(torch.quantile(torch.tensor(diff, dtype=torch.float64), p))  # noqa: E731
    return [q(0.025), q(0.975)]


def test_paired_bootstrap_matches_naive_loop_and_behaves():
    g = torch.Generator().manual_seed(0)
    fa = torch.randint(5, 20, (40,), generator=g)
    fb = torch.randint(5, 20, (40,), generator=g)
    ka = fa * 3 + torch.randint(0, 4, (40,), generator=g)  # ~3.2 tokens per forward
    kb = fb * 2 + torch.randint(0, 4, (40,), generator=g)  # ~2.2
    got = paired_bootstrap(ka, fa, kb, fb, 2, 500, seed=3)
    want = naive_bootstrap(ka.tolist(), fa.tolist(), kb.tolist(), fb.tolist(), 2, 500, 3)
    assert got == pytest.approx(want, abs=1e-12)
    point = float(ka.sum() / fa.sum() - kb.sum() / fb.sum())
    assert 0 < got[0] < point < got[1]  # a clear gain: the interval is above 0 and holds the point estimate
    assert paired_bootstrap(ka, fa, ka, fa, 2, 200) == [0.0, 0.0]  # the same arm twice: exactly 0


@pytest.fixture(scope="module")
def arm():
    tsk = task.CountUpTask(1, 2)
    cfg = Config(**{**PRESETS["test"], "prompts_per_step": 3, "group_size": 2, "updates": 2, "rollout_batch": 4,
                    "micro_batches": 3})  # micro_batches divides the 3 sequences of an update
    torch.manual_seed(0)
    ref = Transformer(ModelConfig.preset("tiny", vocab_size=tsk.tok.vocab_size)).requires_grad_(False)
    draft = Eagle3Draft.from_target(ref)
    return OfflineArm(cfg, tsk, ref, draft, seed=0), cfg


def test_offline_arm_trains_on_fresh_pi0_samples(arm, monkeypatch):
    off, cfg = arm
    seen, sample = [], OfflineArm.sample
    monkeypatch.setattr(OfflineArm, "sample", lambda self: seen.append(sample(self)) or seen[-1])
    ref0 = copy.deepcopy(off.ref.state_dict())
    d0 = [p.clone() for p in off.draft.parameters()]
    for _ in range(2):
        t = off.step()
        assert set(t) == {"offline_sample", "offline_train"} and min(t.values()) > 0
    assert all(b.num_seqs == cfg.prompts_per_step * cfg.group_size for b in seen)  # as many as the rollouts
    assert not torch.equal(seen[0].tokens, seen[1].tokens)  # fresh samples each step, not a reused pool
    assert all(torch.equal(v, ref0[k]) for k, v in off.ref.state_dict().items())  # pi_0 stays pi_0
    assert any(not torch.equal(a, b) for a, b in zip(d0, off.draft.parameters()))
    steps = {int(s["step"]) for s in off.tr.opt.state.values()}
    assert steps == {2 * cfg.updates}  # `updates` optimizer steps per RL step, like the co-trained draft
    assert off.tr.opt.param_groups[0]["lr"] == cfg.draft_lr


def test_e2e_step_times_by_hand():
    rows = [{"step": s, "time": {"rollout": 2.0, "policy_train": 3.0, "draft_train": 1.0, "watch": 9.0}}
            for s in (1, 2)]
    evals = [{"step": 0, "speedup": 1.5}, {"step": 1, "speedup": 2.0}]
    e = e2e_step_times(rows, evals)  # step 1 uses eval 0, step 2 eval 1; the controls' "watch" is not counted
    assert e["e2e_step_s_spec"] == pytest.approx(6.0)
    assert e["e2e_step_s_ar"] == pytest.approx(((2 * 1.5 + 3) + (2 * 2.0 + 3)) / 2)
    assert e["e2e_step_speedup"] == pytest.approx(6.5 / 6.0)
    cold = [{**r, "tau_hat_cotrained": 3.0, "tau_hat_cold": 1.5} for r in rows]  # + a cold arm: half the drafts' time
    assert e2e_step_times(cold, evals)["e2e_step_s_spec"] == pytest.approx(5.5)


def test_only_the_training_stage_holds_the_drafts_optimizers():
    """bf16 drafts trained on the last stage: there an fp32 master and an fp32 .main_grad per parameter; on an
    earlier stage (it only rolls out with them, refit gives it their weights) neither: no optimizer at all."""
    from harness.experiment import draft_arms
    from harness.config import parse_args
    cfg = parse_args(["--preset=test", "--dtype=bf16", "--cold_arm=true"])
    policy = Transformer(ModelConfig.preset("tiny")).to(torch.bfloat16)
    warm = Eagle3Draft.from_target(policy)
    tsk = task.CountUpTask(cfg.min_steps, cfg.max_steps)
    for train in (True, False):
        d = copy.deepcopy(warm)
        d.attach(policy)
        arms = draft_arms(cfg, tsk, policy, d, train)
        assert sorted(arms) == ["cold", "cotrained"]
        for tr in arms.values():
            fp32 = [p for p in tr.draft.parameters() if hasattr(p, "main_grad")]
            assert (tr.opt is not None, bool(fp32)) == (train, train), train
