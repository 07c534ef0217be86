"""train.py: the config/CLI is loud on mistakes, and the whole loop runs end to end at a tiny size (`--preset test`)."""
import json
import os

import pytest
import torch

from harness.experiment import build
from harness.mesh import make_mesh, pick_device
from harness.config import PRESETS, Config, parse_args
from serving.export import check_export
from train import train


def test_parse_args_types_presets_and_flags():
    assert parse_args([]) == Config()
    c = parse_args(["--preset", "smoke", "--steps=3", "--lr=1e-3", "--cold_start", "--std_norm=false", "--out", "x"])
    assert c.name == "smoke" and c.steps == 3 and c.lr == 1e-3 and c.cold_start is True and c.std_norm is False
    assert c.out == "x" and c.sft_steps == PRESETS["smoke"]["sft_steps"]
    assert parse_args(["--preset=test", "--loss_norm=seq-mean"]).loss_norm == "seq-mean"
    assert parse_args(["--steps", "5", "--lr", "1e-3"]) == parse_args(["--steps=5", "--lr=1e-3"])  # --key value


@pytest.mark.parametrize("argv, match", [
    (["--stepz=3"], "unknown config key 'stepz'.*did you mean 'steps'"),
    (["--steps=3.5"], "--steps='3.5': expected a value of type int"),
    (["--cold_start=maybe"], "--cold_start='maybe': expected a value of type bool"),
    (["--lr"], "--lr: expected --lr=<float>"),
    (["--loss_norm=mean"], "--loss_norm=mean: expected one of"),
    (["--steps=0"], "steps=0"),
    (["--preset=huge"], "--preset='huge'"),
    (["steps=3"], "expected --key=value"),
    (["--model=giant"], "--model=giant: expected a preset"),
    (["--lr", "--steps=3"], "--lr: expected --lr=<float> or --lr <float>"),
    (["--draft_warmup_batch=99", "--draft_warmup_pool=8"], "draft_warmup_batch=99"),
    (["--device=gpu"], "--device=gpu: expected one of auto, cpu, cuda"),
])
def test_parse_args_rejects_bad_input_naming_the_key(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_test_preset_runs_end_to_end_then_reuses_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    out = tmp_path / "run"
    s = train(parse_args(["--preset=test", f"--cache_dir={cache}", "--out", str(out)]))
    for key in ("steps", "reward_first", "reward_last", "kl_last", "accept_len_cotrained", "accept_len_frozen",
                "rollout_speedup", "wall_s", "accept_len_cold"):
        assert key in s, key
    assert s["steps"] == PRESETS["test"]["steps"] and s["warmup_cached"] == {"policy": False, "draft": False}
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if r["kind"] == "eval"]
    # at eval 0 the co-trained draft IS the warm-up draft: same weights, prompts and seed -> the same acceptance
    assert evals[0]["accept_cotrained"] == evals[0]["accept_frozen"] == s["accept_len_cotrained_first"]
    assert s["accept_len_cotrained"] == evals[-1]["accept_cotrained"] and s["rollout_speedup"] == evals[-1]["speedup"]
    assert all(e["speedup_range"][0] <= e["speedup"] <= e["speedup_range"][1] for e in evals)  # the paired chunks'
    assert all(r["time"]["draft_train"] > 0 and r["time"]["policy_train"] > 0 for r in rows if r["kind"] == "train")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2]  # eval_every=1
    assert json.load(open(out / "summary.json")) == s
    assert os.path.getsize(out / "train.png") > 10_000
    assert (out / "policy" / "config.json").is_file()  # the servable directories (export.write_servables)
    assert check_export(str(out / "draft"))["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sorted(os.listdir(cache)) == sorted(f for f in os.listdir(cache) if f.startswith(("policy-", "draft-")))
    # second run: the warm-ups come from the cache; --cold_start swaps the rollout draft for an untrained one
    s2 = train(parse_args(["--preset=test", f"--cache_dir={cache}", "--out", str(tmp_path / "run2"), "--cold_start"]))
    assert s2["warmup_cached"] == {"policy": True, "draft": True} and s2["cold_start"] is True
    assert "accept_len_cold" not in s2  # the rollout draft IS the cold-start one


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
        parse_args(["--device=cuda"])


def test_pick_device_one_gpu_per_rank(monkeypatch):
    """auto and cuda: the process's own GPU when every local rank gets one, else an error, never the CPU (CUDA is
    faked here: pick_device only reads the counts, it allocates nothing; tests/test_startup_checks.py has the rest)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device(Config(device="auto")) == torch.device("cuda", 1)
    assert pick_device(Config(device="cuda")) == torch.device("cuda", 1)
    assert pick_device(Config(device="cpu")) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 ranks, 2 GPUs: NCCL cannot share one
    for device in ("auto", "cuda"):
        with pytest.raises(ValueError, match=f"--device={device}: LOCAL_RANK=1 of LOCAL_WORLD_SIZE=4 .* sees 2 GPUs"):
            pick_device(Config(device=device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(Config(device="auto")) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_test_preset_on_cuda(tmp_path):
    """The whole loop with every model on the GPU: warm-ups, speculative rollouts, update, eval, summary."""
    cfg = parse_args(["--preset=test", "--device=cuda", f"--cache_dir={tmp_path / 'cache'}",
                      f"--out={tmp_path / 'run'}"])
    s = build(cfg, make_mesh(cfg), log=lambda *a, **k: None)
    models = [s.policy, s.ref, s.frozen] + [tr.draft for tr in s.drafts.values()]
    assert all(p.is_cuda for m in models for p in m.parameters()) and s.gen.device.type == "cuda"
    summary = train(cfg)
    assert summary["steps"] == PRESETS["test"]["steps"]
    assert summary["accept_len_cotrained_first"] == summary["accept_len_frozen_first"]  # the same draft at eval 0
