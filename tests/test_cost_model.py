"""harness/cost_model.py: the math against hand-computed cases, its monotonicity, k = 0 as autoregressive decoding, and
the check of the stored default run against the stored CPU device figures within the tolerance docs/cost_model.md
claims, and the host's terms and the padded reference counted by hand. Adds ~1 s (measured: `timeout 300 python -m
pytest -q tests/test_cost_model.py`: 0.95 s of tests, 2 shared cores)."""
import json
import math
from dataclasses import replace

import pytest

from harness import cost_check
from harness.cost_inputs import Arch, Device, clamp_fixed, draft_pass_flops, head_flops, layer_bytes, layer_flops
from harness.cost_model import (Workload, draft_opt, draft_train, expected_kept, main, predict, rollout, rollout_block,
                                update)

TOY = Arch(layers=2, hidden=4, heads=1, kv_heads=1, head_dim=4, intermediate=8, vocab=10)
FLOPS_ONLY = Device(F=1e6, BW=1e30, overheads={"o_step": 0.01, "o_dec": 0.001})  # memory never binds


def test_expected_kept_by_hand():
    assert expected_kept(0, (0.9,)) == 1.0  # autoregressive: one token per forward
    assert expected_kept(2, (0.5,)) == pytest.approx(1 + 0.5 + 0.25)  # the last alpha repeats
    assert expected_kept(3, (0.8, 0.5)) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5)
    assert expected_kept(4, (1.0,)) == 5.0  # everything kept: k + 1
    assert expected_kept(4, accept_len=3.2) == 3.2
    with pytest.raises(ValueError, match="accept_len=6"):
        expected_kept(4, accept_len=6)
    with pytest.raises(ValueError, match="alpha"):
        expected_kept(2, (1.5,))


def test_sizes_by_hand():
    mini = Arch.load("mini")  # H 64, 4 heads of 16, 2 kv heads, I 176, V 64, 6 layers, tied
    assert mini.layer_params == 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 176 == 46080
    assert mini.params == 6 * 46080 + 64 * 64  # the tied head / embedding once
    d = Arch.draft_of(mini, 3)
    assert d.layer_params == 128 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 176  # q, k, v read [e; h], 2H
    assert d.params == d.layer_params + 64 * 64 + 3 * 64 * 64  # + its head + fc over 3 taps
    assert layer_flops(TOY, 3, 5.0) == 3 * (2 * 160 + 4 * 4 * 5.0)  # P_layer(TOY) = 48 + 16 + 96 = 160
    assert head_flops(TOY, 2) == 2 * 2 * 4 * 10
    dt = Arch.draft_of(TOY, 3, vocab=6)
    assert draft_pass_flops(dt, 1, 0.0, fc=True) == 2 * dt.layer_params + 2 * 4 * 6 + 2 * 3 * 16
    assert layer_bytes(TOY, 2, 10, 2, 2) == 160 * 2 + 2 * 10 * 2 * 4 * 2
    q = Arch.load("docs/examples/qwen3_8b/config.json")
    assert 8.1e9 < q.params < 8.3e9  # Qwen3-8B: 8.2B parameters as published


def test_rollout_block_by_hand():
    """AR, B = 1 row, p = 2, r = 5 (tail 1): prefill = L (flops(2 tokens, c = 1) / F + o_dec) + head(1) / F,
    then r - 1 = 4 steps of o_step + L (flops(1, c = p + r/2 = 4.5) / F + o_dec) + head(1) / F."""
    w = Workload(rows=1, prompt_len=2, resp_len=5, rollout_batch=1, k=0)
    out = rollout_block(TOY, Arch.draft_of(TOY), FLOPS_ONLY, w, 0)
    prefill = 2 * (2 * (320 + 16 * 1) / 1e6 + 0.001) + 80 / 1e6
    step = 0.01 + 2 * ((320 + 16 * 4.5) / 1e6 + 0.001) + 80 / 1e6
    assert out["steps"] == 4 and out["step_s"] == pytest.approx(step)
    assert out["generate"] == pytest.approx(prefill + 4 * step) == pytest.approx(0.05488)
    slow_mem = replace(FLOPS_ONLY, BW=100.0)  # now the weights' bytes bind: 160 x 4 B / 100 B/s per layer call
    assert rollout_block(TOY, Arch.draft_of(TOY), slow_mem, w, 0)["step_s"] == pytest.approx(
        0.01 + 2 * ((160 * 4 + 1 * 4.5 * 2 * 4 * 4) / 100 + 0.001) + 10 * 4 * 4 / 100)


def test_host_terms_and_padded_reference_by_hand():
    """The host's terms and the padded reference on TOY (P_layer 160, q_dim 4, V 10), B = 2 rows of p = 2 + r = 4
    (tail 1.5: the longest row p + tail r = 8), 4 rows (2 blocks, one process), u = 2 updates of T = 4 x 6 / 2 = 12
    tokens, 2 drafts trained on half the updates. Adds < 0.03 s (pytest --durations: below the file's third slowest,
    0.03 s)."""
    host = {"o_row": 0.001, "o_upd": 0.5, "o_tok_fb": 0.01, "o_dopt": 0.2, "o_layer_pad": 0.003, "o_ref": 0.004}
    dev = Device(F=1e6, BW=1e30, F_pad=1e5, overheads=host)
    w = Workload(rows=4, prompt_len=2, resp_len=4, tail=1.5, rollout_batch=2, k=0, updates=2, drafts=2, draft_share=0.5)
    blk = rollout_block(TOY, Arch.draft_of(TOY), dev, w, 0)
    assert blk["score"] == pytest.approx(2 * 0.001)  # B o_row
    # reference: L (dense 12 x 320 / F + 4 q_dim B (p + tail r)^2 / F_pad + o_layer_pad) + head 2 H V 12 / F + o_ref
    assert blk["reference"] == pytest.approx(2 * (3840 / 1e6 + 4 * 4 * 2 * 8 ** 2 / 1e5 + 0.003) + 960 / 1e6 + 0.004)
    varlen = rollout_block(TOY, Arch.draft_of(TOY), replace(dev, F_pad=0.0), w, 0)["reference"]
    assert varlen == pytest.approx(2 * (layer_flops(TOY, 12, 3.0) / 1e6 + 0.003) + 960 / 1e6 + 0.004)
    assert rollout(TOY, Arch.draft_of(TOY), dev, w, 0)["score"] == pytest.approx(2 * 2 * 0.001)  # 2 blocks
    bare = replace(dev, overheads={k: v for k, v in host.items() if k not in ("o_upd", "o_tok_fb")})
    assert update(TOY, dev, w) - update(TOY, bare, w) == pytest.approx(2 * (12 * 0.01 + 0.5))  # u (T o_tok_fb + o_upd)
    assert draft_opt(dev, w, 2) == pytest.approx(0.5 * 2 * 2 * 0.2)  # share u drafts o_dopt
    out = predict(TOY, dev, w)
    assert out["score"] == pytest.approx(0.004) and out["draft_opt"] == pytest.approx(0.4)
    assert out["step_plain"] == pytest.approx(out["rollout_ar"] + out["reference"] + 0.004 + out["policy_train"])
    assert Device.load("cpu").F_pad > 0 and all(Device.load("cpu").o(k) > 0 for k in ("o_row", "o_upd", "o_dopt"))


def test_k0_is_autoregressive_and_speculation_scales_with_acceptance():
    a, dev = Arch.load("mini"), Device.load("cpu")
    w0 = Workload(k=0)
    out0 = predict(a, dev, w0)
    assert "rollout_spec" not in out0 and out0["e_kept"] == 1.0
    assert out0["step_plain"] == pytest.approx(out0["rollout_ar"] + out0["reference"] + out0["score"]
                                               + out0["policy_train"])
    prev = math.inf
    for acc in (1.0, 2.0, 3.0, 4.0, 5.0):  # more kept per verify -> fewer verify steps -> faster rollouts
        out = predict(a, dev, Workload(k=4, accept_len=acc))
        assert out["rollout_spec"] < prev
        assert out["rollout_ar"] == pytest.approx(out0["rollout_ar"])  # the baseline does not see the draft
        prev = out["rollout_spec"]
    lo, hi = predict(a, dev, Workload(k=4, alpha=(0.5,))), predict(a, dev, Workload(k=4, alpha=(0.9,)))
    assert hi["rollout_speedup"] > lo["rollout_speedup"] and hi["e2e_speedup"] > lo["e2e_speedup"]


def test_more_draft_training_slows_the_step():
    a, dev = Arch.load("mini"), Device.load("cpu")
    base = Workload(k=4, accept_len=4.0)
    outs = [predict(a, dev, replace(base, ttt_passes=p)) for p in (1, 3, 7)]
    assert outs[0]["step_cospec"] < outs[1]["step_cospec"] < outs[2]["step_cospec"]
    assert outs[0]["e2e_speedup"] > outs[1]["e2e_speedup"] > outs[2]["e2e_speedup"]
    assert all(o["step_plain"] == outs[0]["step_plain"] for o in outs)  # plain GRPO trains no draft
    d = Arch.draft_of(a)
    assert draft_train(a, d, dev, base, 2) == pytest.approx(2 * draft_train(a, d, dev, base, 1))
    assert update(a, dev, replace(base, checkpointing=True)) > update(a, dev, base)


def test_check_reproduces_the_stored_default_run():
    """A deterministic computation on stored data: docs/examples/cost_check_run (metrics.jsonl and its config.json), the
    stored CPU figures (bench/results/cost_device_cpu.json, from bench/probe_cost.py), the task's seeded
    demonstrations. It reproduces docs/cost_model.md's table (predicted s/step to 1 ms) and the tolerance that page
    claims for it: within ±50% (rollout +48%, policy_train +30% with the update's communication). That run is 4
    ranks on 2 cores on a loaded machine, wall seconds, at an earlier commit: its miss is the contention and the load,
    not the model's counts, which the single-process runs on a quiet machine and both 4-rank runs with the quiet
    figures check within ±15% (docs/cost_model.md; the single-process runs are not stored in the repository)."""
    res = cost_check.check("docs/examples/cost_check_run", Device.load("cpu"))
    assert res["_inputs"]["steps"] == 30 and res["_inputs"]["world"] == 4
    table = {"rollout": (0.926, 1.370), "policy_train": (1.591, 2.070), "draft_train": (1.818, 2.171)}
    for c in cost_check.COMPONENTS:
        measured, predicted, err = res[c]
        assert (measured, predicted) == pytest.approx(table[c], abs=1e-3), c
        assert abs(err) <= 0.50, (c, measured, predicted)
    assert cost_check.check("docs/examples/cost_check_run", Device.load("cpu")) == res
    assert "| rollout | 0.926 | 1.370 |" in cost_check.table(res, 0.15)


def test_a_probe_clamps_a_fixed_overhead_below_zero_and_says_so():
    """bench/probe_cost.py writes what Device.load accepts: a fixed overhead fitted below 0 (a residual under the
    noise, e.g. o_vstep -2.27 ms on a 2-core machine) becomes 0 and is named; slopes keep their sign. ~0 s."""
    fitted = {"o_vstep": -0.00227, "o_dec": 0.0009, "o_pass_tok": -8e-6, "o_seq": 1e-4}
    with pytest.raises(ValueError, match="o_vstep=-0.00227: expected seconds >= 0"):
        Device(overheads=fitted).check()
    o, note = clamp_fixed(fitted)
    assert o == {"o_vstep": 0.0, "o_dec": 0.0009, "o_pass_tok": -8e-6, "o_seq": 1e-4}
    assert note == "clamped to 0, below the noise: o_vstep -2.270 ms"
    Device(overheads=o).check()
    assert clamp_fixed({"o_dec": 0.0009}) == ({"o_dec": 0.0009}, "")


@pytest.mark.parametrize("path", ["bench/results/cost_device_cpu.json", "bench/results/cost_device_cpu_quiet.json",
                                  "docs/examples/cost_device_h100.json", "docs/examples/cost_device_cpu_661192c.json",
                                  "docs/examples/cost_device_cpu_661192c_run2.json"])
def test_every_committed_device_file_loads(path):
    """The device files the docs' commands name load as they are (a fitted per-token slope may be < 0; a fixed
    overhead may not). ~0 s."""
    dev = Device.load(path)
    assert dev.F > 0 and all(v >= 0 for k, v in dev.overheads.items() if not k.endswith(("_tok", "_seq")))
    with pytest.raises(ValueError, match="o_pass1=-1.0: expected seconds >= 0"):
        replace(dev, overheads={**dev.overheads, "o_pass1": -1.0}).check()


def test_bad_inputs_name_what_was_expected(tmp_path, capsys):
    with pytest.raises(ValueError, match="--model='nope'"):
        Arch.load("nope")
    bad = tmp_path / "dev.json"
    bad.write_text(json.dumps({"F": 1.0, "BW": 1.0, "flops": 3}))
    with pytest.raises(ValueError, match="unknown device field"):
        Device.load(str(bad))
    with pytest.raises(ValueError, match="--alpha='x'"):
        main(["--alpha", "x"])
    with pytest.raises(ValueError, match="RUN="):
        cost_check.load_run(str(tmp_path))
    with pytest.raises(ValueError, match="--cpu: .* ran 4 ranks"):  # its CPU seconds are the ranks' sum
        cost_check.check("docs/default_run_metrics.jsonl", Device.load("cpu"), cpu=True)
    assert main(["--model", "mini", "--k", "4", "--accept_len", "3"]) == 0
    out = capsys.readouterr().out
    assert "A MODEL, not a measurement" in out and "end-to-end step speedup" in out


def test_check_reads_a_plain_single_process_run(tmp_path):
    """A plain-GRPO run (config no_spec, accept_len logged as 1, no draft trained) in one process: the prediction is
    the autoregressive rollout and no TTT; --cpu compares the records' CPU seconds without contention."""
    rec = {"kind": "train", "step": 1, "resp_len": 40.0, "accept_len": 1.0, "explicit": 0.7, "rank_rows": [256],
           "time": {"rollout": 3.0, "policy_train": 2.0, "draft_train": 0.0,
                    "cpu": {"rollout": 1.5, "policy_train": 1.0, "draft_train": 0.0}}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"no_spec": True, "cold_arm": "auto", "updates": 2}))
    dev = Device.load("cpu")
    res = cost_check.check(str(tmp_path), dev)
    w = Workload(rows=256, prompt_len=res["_inputs"]["prompt_len"], resp_len=40.0, tail=res["_inputs"]["tail"], k=0,
                 drafts=0)
    out = predict(Arch.load("mini"), dev, w)
    assert res["rollout"][1] == pytest.approx(out["rollout_ar"] + out["reference"] + out["score"])
    assert res["draft_train"][:2] == (0.0, 0.0) and res["draft_train"][2] == 0.0
    cpu = cost_check.check(str(tmp_path), dev, cpu=True)
    assert cpu["rollout"][0] == 1.5 and cpu["rollout"][1] == pytest.approx(res["rollout"][1])  # one process: no C(A)


def test_draft_budget_share_and_the_documented_qwen3_8b_prediction():
    """--draft_every n trains the drafts on global updates divisible by n; the docs' Qwen3-8B table (a model on the
    assumed H100 figures of docs/examples/cost_device_h100.json) is what the model computes."""
    from harness.config import Config
    assert [cost_check._draft_share(Config(draft_every=4, updates=2), s) for s in (1, 2, 3)] == [0.5, 0.0, 0.5]
    assert cost_check._draft_share(Config(draft_every=1), 7) == 1.0
    q = Arch.load("docs/examples/qwen3_8b/config.json")
    w = Workload(rows=1024, prompt_len=512, resp_len=8192, rollout_batch=32, k=3, accept_len=2.47, updates=4, dp=8,
                 checkpointing=True, draft_vocab=32000)
    out = predict(q, Device.load("h100"), w)
    got = [out[k] for k in ("rollout_ar", "rollout_spec", "reference", "policy_train", "draft_train_1")]
    assert got == pytest.approx([485.5, 224.3, 39.9, 235.5, 30.9], abs=0.06)
    assert out["score"] == pytest.approx(4 * 32 * 0.001)  # ceil(32 blocks / 8 ranks) x 32 rows x o_row 1 ms
    assert (out["rollout_speedup"], out["e2e_speedup"]) == pytest.approx((2.165, 1.434), abs=5e-4)
    before = predict(q, Device.load("h100"), replace(w, pi_old_forward=False))  # pi_old read from the rollout
    assert before["policy_train"] == pytest.approx(198.1, abs=0.06)
    half = predict(q, Device.load("h100"), replace(w, draft_share=0.5))
    assert half["draft_train_1"] == pytest.approx(out["draft_train_1"] / 2)
