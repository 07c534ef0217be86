"""docs/EXTENDING.md's examples run: every file under docs/examples/ is in the doc verbatim (so the doc cannot drift
from what runs), and every `python train.py ...` line of the doc's bash blocks runs in-process, one step (--steps=1),
each with its own --out and one shared cache; each flag's effect is checked where it lands. The HF-mode command
(--reward) runs on a tiny random Llama and prompts file built here, in place of its PATH and prompts.jsonl.
Measured: 24 s on a quiet 2-core machine, 45 s to 54 s with it shared by other jobs, nearly all of it the tiny runs
and their warm-ups.
"""
import glob
import importlib
import json
import os
import re
import shlex

import pytest
import torch

import draft
from harness.config import parse_args
from rl_loop import LOSS_NORMS, aggregate
from train import train
from hf_util import write_jsonl, write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = open(os.path.join(ROOT, "docs", "EXTENDING.md"), encoding="utf-8").read()
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "docs", "examples", "*.py")))
for path in EXAMPLES:  # the doc's example files, imported as a user's module would be (the normalisation registers)
    importlib.import_module("docs.examples." + os.path.basename(path)[:-3])


def blocks(lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)


COMMANDS = [line for b in blocks("bash") for line in b.splitlines() if line.startswith("python train.py ")]


def test_the_doc_shows_every_example_file_verbatim_and_each_is_small():
    shown = [b.strip() for b in blocks("python")]
    assert len(EXAMPLES) == 4 and len(COMMANDS) == 6
    for path in EXAMPLES:
        text = open(path, encoding="utf-8").read()
        assert text.strip() in shown, f"{os.path.relpath(path, ROOT)} differs from its block in docs/EXTENDING.md"
        assert DOC.count(text.strip()) == 1, f"{os.path.relpath(path, ROOT)} shown more than once"
        assert text.count("\n") <= (160 if path.endswith("mlp_drafter.py") else 36), path  # a whole draft family


def test_the_registered_example_normalisation_is_linear():
    """dist_step's weights need L linear in the per-token losses: L(a l1 + b l2) = a L(l1) + b L(l2)."""
    assert "seq-sum" in LOSS_NORMS
    g = torch.Generator().manual_seed(0)
    l1, l2 = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    mask, cu = torch.rand(9, generator=g) > 0.3, torch.tensor([0, 4, 9], dtype=torch.int32)
    kw = dict(n_seqs=3, n_tokens=7, max_len=5, n_micro=2)
    L = lambda x: aggregate(x, mask, cu, "seq-sum", **kw)  # noqa: E731
    assert float(L(2 * l1 - 3 * l2)) == pytest.approx(float(2 * L(l1) - 3 * L(l2)))
    assert float(L(l1)) == pytest.approx(float((l1 * mask).sum() / 3))


def exported_architecture(out) -> str:
    return json.load(open(out / "draft" / "config.json"))["architectures"][0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """The HF command's PATH and prompts.jsonl: a tiny random Llama whose words make it write numbers, with the
    layers an exported EAGLE-3 draft needs (3 taps below the last layer)."""
    root = tmp_path_factory.mktemp("hf")
    words = "What is + ? 0 1 2 3 4 5".split()
    model = write_tiny_llama(root / "llama", extra_vocab=0, num_hidden_layers=6, words=words)
    rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(3) for b in range(3)]
    return {"PATH": str(model), "prompts.jsonl": write_jsonl(root / "prompts.jsonl", rows)}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_of_the_doc_runs(command, cache, tmp_path, monkeypatch, request):
    weights, ttt_loss = [], draft.Eagle3Draft.ttt_loss
    monkeypatch.setattr(draft.Eagle3Draft, "ttt_loss",
                        lambda self, *a, **k: weights.append(k.get("pass_weight")) or ttt_loss(self, *a, **k))
    argv = shlex.split(command)[2:] + ["--steps=1", f"--out={tmp_path}", f"--cache_dir={cache}"]
    calls = []
    if "--model" in argv:  # HF mode: the files built here, a response budget inside the tiny model's context
        files = request.getfixturevalue("hf_files")
        argv = [files.get(a, a) for a in argv] + ["--max_new_tokens=10"]
        mod, _, fn = next(a for a in argv if a.startswith("--reward=")).partition("=")[2].partition(":")
        reward = getattr(importlib.import_module(mod), fn)
        monkeypatch.setattr(importlib.import_module(mod), fn, lambda *a: calls.append(a) or reward(*a))
    cfg = parse_args(argv)
    s = train(cfg)
    assert s["steps"] == 1 and os.path.isfile(tmp_path / "metrics.jsonl")
    assert set(weights) == ({cfg.ttt_decay} if cfg.drafter == "eagle3" else set())  # every arm alike; TTT's only
    assert exported_architecture(tmp_path) == {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel"}[
        cfg.drafter]
    exported = json.load(open(tmp_path / "draft" / "config.json"))
    if cfg.tap_layers:  # the export names the configured taps (vLLM: + 1; SGLang: as they are)
        assert exported["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in cfg.tap_layers]
        assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(cfg.tap_layers)
    if cfg.reward:  # every response was scored by the example's function: prompt, response, the row's answer
        assert calls and all(len(c) == 3 and all(isinstance(x, str) for x in c) for c in calls)
        assert {c[2] for c in calls} <= {str(a + b) for a in range(3) for b in range(3)}
    if cfg.task != "countup":  # the example task's own tokenizer sized the policy
        assert json.load(open(tmp_path / "policy" / "config.json"))["vocab_size"] == 6
