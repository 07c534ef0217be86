"""Plain GRPO beside the co-trained run: --no_spec holds no draft, the draft-training budget (--draft_every) skips the
drafts exactly, and harness/e2e.py measures the e2e step from two runs' timers with a paired bootstrap over steps.

Seconds added (2 cores, measured): ~12 s in all -- two test-preset runs (~4 s each with cached warm-ups, ~6 s for the
first), the rest under a second.
"""
import json
import math

import pytest
import torch
from test_dist_step import grpo, make_batch, make_models, make_policy_opt

from dist_step import DistCotrainer
from harness.config import parse_args
from harness.e2e import measured_e2e, ratio_interval
from harness.report import add_baseline
from parallel.grid import Grid
from train import train


def cotrainer(policy, drafts):
    return DistCotrainer(policy, drafts, Grid(), make_policy_opt, grad_clip=1.0)


def test_an_update_without_the_drafts_is_the_plain_update_and_leaves_them_untouched():
    """DistCotrainer.step(train_drafts=False) == a cotrainer with no drafts at all (bit for bit: the taps are detached,
    so the drafts never touch the policy's gradient), no tap is formed and no draft moves."""
    policy, drafts = make_models()
    plain_policy, _ = make_models()
    batch = make_batch(policy)
    before = [p.detach().clone() for tr in drafts for p in tr.draft.parameters()]
    ct, plain = cotrainer(policy, drafts), cotrainer(plain_policy, [])
    st = ct.step(batch, grpo("global-token"), micro_batches=2, train_drafts=False)
    ref = plain.step(batch, grpo("global-token"), micro_batches=2)
    ct.refit(policy)
    plain.refit(plain_policy)
    assert st["loss_policy"] == ref["loss_policy"] and st["grad_norm"] == ref["grad_norm"]
    for (name, a), b in zip(policy.state_dict().items(), plain_policy.state_dict().values()):
        assert torch.equal(a, b), name
    after = [p for tr in drafts for p in tr.draft.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert st["draft_metrics"] == [None, None]
    st = ct.step(batch, grpo("global-token"), micro_batches=2)  # and the next budgeted update trains them
    assert st["draft_metrics"][0] is not None and not all(
        torch.equal(a, b) for a, b in zip(before, (p for tr in drafts for p in tr.draft.parameters())))


def test_budget_picks_every_nth_update_and_the_offline_arm_is_trained_as_much(tmp_path, monkeypatch):
    """--draft_every=3 with updates=2: the drafts train on updates 0, 3 of steps 1-2 (one per step); the offline arm
    takes the same number of TTT steps each step."""
    import harness.offline_arm
    calls, offline = [], []
    real_step, real_off = DistCotrainer.step, harness.offline_arm.OfflineArm.step
    monkeypatch.setattr(DistCotrainer, "step", lambda self, *a, train_drafts=True, **k: (
        calls.append(train_drafts), real_step(self, *a, train_drafts=train_drafts, **k))[1])
    monkeypatch.setattr(harness.offline_arm.OfflineArm, "step", lambda self, n=None: (
        offline.append(n), real_off(self, n))[1])
    argv = ["--preset", "test", "--steps=3", f"--out={tmp_path / 'run'}", f"--cache_dir={tmp_path / 'cache'}",
            "--draft_every=3", "--eval_every=10"]
    s = train(parse_args(argv))
    assert calls == [True, False, False, True, False, False] and offline == [1, 1]  # step 3 trains none: no sampling
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[2]["tau_hat_cotrained"] is None and train_rows[2]["loss_draft"] is None
    assert train_rows[2]["time"]["draft_train"] == 0.0 and train_rows[0]["tau_hat_cotrained"] is not None
    assert s["draft_every"] == 3 and math.isfinite(s["tau_hat_cotrained_last"])


def rows(parts: list) -> list:
    return [{"kind": "train", "step": i + 1, "tau_hat_cotrained": 1.0, "tau_hat_cold": 1.0,
             "time": {"rollout": r, "policy_train": p, "draft_train": d, "cpu": {"rollout": r, "policy_train": p,
                                                                               "draft_train": d}}}
            for i, (r, p, d) in enumerate(parts)]


def test_measured_e2e_is_the_ratio_of_summed_steps_with_a_bootstrap_interval():
    spec = rows([(1.0, 2.0, 1.0), (1.2, 2.0, 0.8), (0.8, 2.2, 1.2)])  # the draft time: two drafts -> half each
    plain = [{"kind": "train", "step": i + 1, "time": {"rollout": r, "policy_train": p, "cpu": {
        "rollout": r, "policy_train": p}}} for i, (r, p) in enumerate([(1.5, 1.9), (1.6, 2.0), (1.4, 2.1)])]
    m = measured_e2e(spec, plain, n_boot=500)
    want = (1.5 + 1.9 + 1.6 + 2.0 + 1.4 + 2.1) / (1.0 + 2.0 + 0.5 + 1.2 + 2.0 + 0.4 + 0.8 + 2.2 + 0.6)
    assert m["e2e_step_speedup_measured"] == pytest.approx(want, rel=1e-12)
    assert m["e2e_step_speedup_measured_cpu"] == pytest.approx(want, rel=1e-12)
    lo, hi = m["e2e_step_speedup_measured_ci"]
    assert lo <= want <= hi and hi - lo > 0
    assert m["e2e_parts"]["spec"]["draft_train"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="baseline: trained a draft"):
        measured_e2e(spec, spec)
    with pytest.raises(ValueError, match="run: has no co-trained draft"):
        measured_e2e(plain, plain)
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(40, generator=g, dtype=torch.float64) + 1, torch.rand(40, generator=g, dtype=torch.float64) + 1
    lo, hi = ratio_interval(a, b, n=4000)  # ~ the normal-approximation interval of a ratio of means
    assert lo < float(a.sum() / b.sum()) < hi and 0.05 < hi - lo < 0.5


def test_no_spec_runs_plain_grpo_and_the_report_measures_it(tmp_path):
    common = ["--preset", "test", f"--cache_dir={tmp_path / 'cache'}"]
    base = train(parse_args(common + ["--no_spec", f"--out={tmp_path / 'plain'}"]))
    assert base["no_spec"] and "rollout_speedup" not in base and "accept_len_cotrained" not in base
    assert not (tmp_path / "plain" / "draft").exists() and (tmp_path / "plain" / "policy").is_dir()
    recs = [json.loads(line) for line in open(tmp_path / "plain" / "metrics.jsonl")]
    assert all(r["loss_draft"] is None and "tau_hat_cotrained" not in r for r in recs if r["kind"] == "train")
    assert all(set(r["time"]["cpu"]) == {"rollout", "policy_train", "draft_train", "watch"}
               for r in recs if r["kind"] == "train")
    train(parse_args(common + [f"--out={tmp_path / 'spec'}"]))
    m = add_baseline(str(tmp_path / "spec"), str(tmp_path / "plain"))
    s = json.loads((tmp_path / "spec" / "summary.json").read_text())
    assert s["e2e_step_speedup_measured"] == m["e2e_step_speedup_measured"] > 0 and s["baseline"].endswith("plain")
    lo, hi = s["e2e_step_speedup_measured_ci"]
    assert lo <= s["e2e_step_speedup_measured"] <= hi
    assert "e2e_step_speedup" in s  # the computed one stays beside it
    with pytest.raises(ValueError, match="expected a plain-GRPO run"):
        add_baseline(str(tmp_path / "spec"), str(tmp_path / "spec"))
