"""harness/fit_check.py: a run whose memory plan exceeds its device stops before any work, in one line naming the flags
that make it fit; the flags it names do fit; --micro_batches=auto and --micro_batch_tokens resolve from the plan.

The GPU node's command is planned here as its 8 ranks would plan it (WORLD_SIZE=8, --device_gib 79.1: an 80 GB
card): Qwen3-8B's config.json (docs/examples/qwen3_8b) with a word tokenizer beside it, no weights (the check reads
none). An absurd draft (--drafter dspark --markov_rank 1e9) is refused by train.py itself, before the warm-ups.
~4 s on 2 cores (the train.py run ~2 s of it).
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hf_util import write_jsonl, write_word_tokenizer

from harness.config import parse_args
from harness.fit_check import GiB, check_fit, fit, model_config, plan_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = ["--pp", "2", "--cp", "4", "--dtype", "bf16", "--device_gib", "79.1"]


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    """A checkpoint directory with Qwen3-8B's config.json and a tokenizer (no weights), and a prompts file."""
    d = tmp_path_factory.mktemp("qwen3_8b")
    shutil.copy(os.path.join(ROOT, "docs", "examples", "qwen3_8b", "config.json"), d / "config.json")
    write_word_tokenizer(d, "What is + ? 0 1 2 3".split())
    data = write_jsonl(d / "p.jsonl", [{"prompt": f"What is {a} + 1 ?", "answer": a + 1} for a in range(4)])
    return str(d), data


def node(qwen3_8b, *extra):
    model, data = qwen3_8b
    return parse_args(["--model", model, "--data", data, *NODE, *extra])


def test_the_node_command_with_the_defaults_is_refused_naming_the_flags_that_fit(qwen3_8b, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError) as e:
        fit(node(qwen3_8b))
    line = str(e.value)
    assert "\n" not in line and line.startswith("fit check: a rank of pipeline stage")
    assert "over the 75.1 GiB it may hold (--device_gib=79.1, 5% kept free)" in line and "--fit_check=false" in line
    flags = line.split("; with ")[1].split(" it plans ")[0]  # the flags that fit, as the line names them
    assert "--micro_batches" in flags, line
    cfg = fit(node(qwen3_8b, *flags.split()))  # the named flags start
    model = model_config(qwen3_8b[0], cfg)
    worst = max(p["total"] for p in plan_of(cfg, model, (2, 4, 1), torch.device("cpu"), 256))
    assert worst <= 0.95 * 79.1 * GiB


def test_micro_batches_auto_and_a_token_budget_resolve_from_the_plan(qwen3_8b):
    cfg = node(qwen3_8b)
    model = model_config(qwen3_8b[0], cfg)
    rest = ("--zero1", "--draft_vocab=32000")  # what else the node needs (the refusal above names it)
    auto = check_fit(node(qwen3_8b, *rest, "--micro_batches=auto"), model, (2, 4, 1), torch.device("cpu"), 256)
    fits = lambda m: max(p["total"] for p in plan_of(  # noqa: E731
        node(qwen3_8b, f"--micro_batches={m}", *rest), model, (2, 4, 1), torch.device("cpu"), 256))
    m = auto.micro_batches
    assert fits(m) <= 0.95 * 79.1 * GiB < fits(m // 2), m  # the fewest that fit (a divisor of the 128 sequences)
    budget = check_fit(node(qwen3_8b, *rest, f"--micro_batch_tokens={128 // m * 1280 // 4}"), model, (2, 4, 1),
                       torch.device("cpu"), 256)
    assert budget.micro_batches == m  # (1024 + 256) tokens per sequence, a quarter of them per CP rank
    off = check_fit(node(qwen3_8b, "--fit_check=false"), model, (2, 4, 1), torch.device("cpu"), 256)
    assert off.micro_batches == 1  # refused otherwise: --fit_check=false starts anyway


def test_an_absurd_draft_is_refused_before_any_warm_up(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--preset=test", "--drafter=dspark", "--markov_rank=1000000000",
                        f"--out={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "fit check" in lines[0] and "--markov_rank=1000000000" in lines[0], r.stderr
    assert "sft step" not in r.stdout + r.stderr and not (tmp_path / "cache").exists()  # no warm-up began


def test_the_default_runs_fit_this_host(monkeypatch):
    for argv, world in (([], "1"), (["--preset=smoke"], "4")):
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", world)
        cfg = fit(parse_args(argv))
        assert cfg == parse_args(argv)  # it fits: nothing to resolve, --zero1=auto left to the build (the CPU: off)
