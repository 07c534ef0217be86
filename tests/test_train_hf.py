"""train.py in HF mode (--model DIR --data prompts.jsonl) on a tiny random Llama checkpoint and BPE tokenizer built
here (nothing downloaded): the config checks, the rollout rewards are the math-answer reward of the decoded responses,
and the whole loop runs end to end."""
import json
import math
import os
import random

import pytest
import torch

from harness.experiment import build
from harness.mesh import make_mesh
from harness.rollout import rollout
from tasks.hf_task import HFTask, math_answer_reward
from dist_util import run_torchrun, why
from hf_util import write_sum_task
from harness.config import parse_args
from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    return write_sum_task(tmp_path_factory.mktemp("hf"))


def hf_argv(hf_files, tmp_path):
    model, data = hf_files
    return ["--preset", "test", "--model", model, "--data", data, "--max_new_tokens", "10", "--eval_fraction=0.3",
            "--cache_dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]


def test_config_checks_for_hf_mode(hf_files, tmp_path):
    model, data = hf_files
    assert parse_args(hf_argv(hf_files, tmp_path)).hf_mode and not parse_args([]).hf_mode
    with pytest.raises(ValueError, match="HF mode needs --data"):
        parse_args(["--model", model])
    with pytest.raises(ValueError, match="--data=nope.jsonl: expected '' or a jsonl / parquet file"):
        parse_args(["--model", model, "--data=nope.jsonl"])
    with pytest.raises(ValueError, match="need --model=<HF checkpoint directory>"):
        parse_args([f"--data={data}"])
    with pytest.raises(ValueError, match="has no config.json"):
        parse_args([f"--model={tmp_path}", f"--data={data}"])
    with pytest.raises(ValueError, match="expected a preset"):
        parse_args(["--model=not/a/dir"])
    with pytest.raises(ValueError, match="--task=docs.examples.parity_task:ParityTask: HF mode"):
        parse_args(hf_argv(hf_files, tmp_path) + ["--task=docs.examples.parity_task:ParityTask"])
    assert parse_args(["--tap_layers=0,1,2"]).tap_layers == (0, 1, 2)  # the 6-layer mini policy can feed them
    assert json.load(open(os.path.join(model, "config.json")))["num_hidden_layers"] == 2  # this one cannot
    with pytest.raises(ValueError, match=r"--tap_layers=0,1,2: expected '' \(the family's default rule"):
        parse_args(hf_argv(hf_files, tmp_path) + ["--tap_layers=0,1,2"])


def test_hf_rollout_is_scored_by_the_math_answer_reward(hf_files, tmp_path):
    cfg = parse_args(hf_argv(hf_files, tmp_path))
    mesh = make_mesh(cfg)
    s = build(cfg, mesh, log=lambda *a, **k: None)
    assert isinstance(s.task, HFTask) and s.task.max_new_tokens == 10
    # HF mode holds only what it uses by default: no control arm, no reference (beta = 0, no KL log)
    assert list(s.drafts) == ["cotrained"] and s.frozen is None and s.offline is None and s.ref is None
    assert s.policy.cfg.vocab_size == s.task.model_vocab_size and s.policy.cfg.architecture == "LlamaForCausalLM"
    train_prompts = {e.prompt for e in s.task.splits["train"]}
    assert len(s.eval_problems) == 2 and not train_prompts & {e.prompt for e in s.eval_problems}  # eval_prompts=2
    problems = s.task.sample(3, random.Random(0))
    batch, info = rollout(s, mesh, problems)  # group_size 4: 12 rows
    cu, tok = batch.cu_seqlens.tolist(), s.task.tok
    responses = [batch.tokens[a:b][batch.resp_mask[a:b]] for a, b in zip(cu[:-1], cu[1:])]
    assert len(responses) == 12 and all(0 < r.numel() <= 10 for r in responses)
    prompts = [s.task.encode_prompt(p) for p in problems for _ in range(4)]
    for a, p in zip(cu[:-1], prompts):
        assert torch.equal(batch.tokens[a: a + p.numel()], p)  # the checkpoint tokenizer's prompt, BOS included
    want = [math_answer_reward(tok.decode(r), problems[i // 4].answer) for i, r in enumerate(responses)]
    assert info["reward"] == pytest.approx(sum(want) / len(want)) and info["explicit"] == 0.0
    assert 0 < sum(want) < len(want)  # this tokenizer makes a random model write numbers: rewards vary


def test_hf_mode_runs_end_to_end(hf_files, tmp_path):
    """With the controls and the KL log asked for (off by default in HF mode)."""
    s = train(parse_args(hf_argv(hf_files, tmp_path) + ["--steps=3", "--frozen_arm", "--cold_arm", "--log_kl"]))
    for key in ("reward_first", "reward_last", "kl_last", "accept_len_cotrained", "accept_len_frozen",
                "rollout_speedup", "accept_len_cold"):
        assert math.isfinite(s[key]), key
    assert s["steps"] == 3 and s["warmup_cached"] == {"policy": True, "draft": False}
    assert 1.0 <= s["accept_len_cotrained"] <= 1 + 3  # num_draft_tokens = 3
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(0 < r["resp_len"] <= 10 and 0 <= r["reward"] <= 1 for r in rows)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert any(r["grad_norm"] > 0 for r in train_rows[:-1]) and s["kl_last"] > 0  # rewards varied; the policy moved


def test_hf_mode_under_torchrun_pp2_cp2(hf_files, tmp_path):
    """The same run on a 4-process gloo mesh: the HF checkpoint is split into pipeline stages like the built-in one."""
    r = run_torchrun(["train.py", *hf_argv(hf_files, tmp_path), "--steps=3", "--pp=2", "--cp=2"], 4, timeout=300)
    assert r.returncode == 0, why(r)
    assert "mesh: dp=1 x pp=2 x cp=2" in r.stdout and "policy: HF checkpoint" in r.stdout
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["steps"] == 3 and all(math.isfinite(s[k]) for k in ("reward_last", "accept_len_cotrained"))
    # the defaults: no control arm, no reference, so no KL
    assert s["kl_last"] is None and not any(f"accept_len_{a}" in s for a in ("frozen", "offline", "cold"))


def test_warmup_command_prebuilds_the_hf_draft(hf_files, tmp_path):
    """`python -m harness.warmup` in HF mode trains and caches the draft warm-up that train.py then loads (the same
    cache key), so a torchrun start need not build it on rank 0 while the others wait. Adds ~15 s."""
    import subprocess
    import sys
    argv = hf_argv(hf_files, tmp_path)
    r = subprocess.run([sys.executable, "-m", "harness.warmup"] + argv, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "draft (trained)" in r.stdout, r.stdout + r.stderr[-2000:]
    s = train(parse_args(argv + ["--steps=1"]))
    assert s["warmup_cached"] == {"policy": True, "draft": True}
