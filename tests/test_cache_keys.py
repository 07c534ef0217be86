"""The warm-ups' cache keys (harness/cache_keys.py): every input a warm-up reads is in its key, nothing unstable is.

Keys are computed as a run computes them (experiment.build_task, policy_key, draft_spec), without training. Each config
field the computation reads (recorded by a stand-in config) is changed alone and must give a new key; the built-in
task and HF mode (a word-level tokenizer, a config.json and a prompts file written here: no weights) each have a
table of changes, and a field read without a row in it fails the test. Also: each spec field alone, the data file's
and the chat template file's contents at the same path, an edit to any file of the warm-up's code (the source read
through a monkeypatched cache_keys.module_source), and the same key in a fresh process with another hash seed.
~9 s of test time on a shared 2-core CPU (39 tests; ~5 s of it the fresh process), plus the imports.
"""
import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

from backends.attention_padded import padded_branch_attention, padded_causal_attention
from harness import cache_keys, warmup
from harness.cache_keys import DraftSpec, PolicySpec, cache_key, code_files
from harness.config import parse_args
from harness.experiment import build_task, draft_spec, policy_key
from hf_util import write_jsonl, write_word_tokenizer
from model import ModelConfig
from tasks import task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def keys(cfg) -> tuple[str, str]:
    """(policy key, draft key) as a run computes them."""
    tsk = build_task(cfg)
    pk = policy_key(cfg, tsk)
    return pk, draft_spec(cfg, tsk, pk).key()


class Reads:
    """A config stand-in recording the fields read through it (a property runs on it, so its fields count)."""

    def __init__(self, cfg):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name):
        prop = getattr(type(self._cfg), name, None)
        if isinstance(prop, property):
            return prop.fget(self)
        self.read.add(name)
        return getattr(self._cfg, name)


def reads(cfg) -> tuple[set, set]:
    """(fields the policy key reads incl. the task's, fields both keys read)."""
    r = Reads(cfg)
    tsk = build_task(r)
    pk = policy_key(r, tsk)
    policy_reads = set(r.read)
    draft_spec(r, tsk, pk).key()
    return policy_reads, r.read


DRAFT_CHANGES = {"draft_warmup_steps": 3, "draft_warmup_batch": 5, "draft_warmup_lr": 2e-3, "draft_warmup_pool": 9,
                 "ttt_passes": 2, "draft_vocab": 6, "seed": 1, "tap_layers": (0, 1, 2), "ttt_decay": 0.5,
                 "rollout_batch": 5, "drafter": "dflash", "dtype": "bf16"}
BUILTIN_CHANGES = {"model": "mini", "min_steps": 2, "max_steps": 3, "p_explicit": 0.5, "format_weight": 1.0,
                   "max_new_tokens": 7, "sft_steps": 4, "sft_batch": 9, "sft_lr": 2e-2,
                   "task": "docs.examples.parity_task:ParityTask", **DRAFT_CHANGES}
HF_CHANGES = {"model": "<other checkpoint>", "data": "<other data>", "prompt_key": "question", "answer_key": "solution",
              "chat_template": "<other template>", "eval_fraction": 0.4, "max_prompt_tokens": 50, "max_new_tokens": 11,
              **DRAFT_CHANGES}
UNREAD = {"name": "other", "out": "elsewhere", "cache_dir": "other_cache", "threads": 2, "warmup_threads": 1,
          "device": "cpu", "lr": 1e-4, "steps": 5, "rl_seed": 3, "draft_lr": 1e-4, "temperature": 0.5,
          "chunk_mib": 1.5}  # chunk_mib: rounding only, passed beside the spec
NOT_KEYED = {"reward"}  # read into the task (its score), but no warm-up reads a reward (tasks/hf_reward.py)


def write_checkpoint(path, words="What is + ? 0 1 2 3 4 5 6".split()) -> str:
    """Tokenizer files and a config.json: all a task and a key read of a checkpoint (no weights)."""
    V = write_word_tokenizer(path, words)
    (path / "config.json").write_text(json.dumps({"vocab_size": V, "max_position_embeddings": 256,
                                                  "mask_token_id": 3}))  # <unk>: --drafter=dflash's MASK
    return str(path)


def write_prompts(path, offset: int = 0) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b} ?"}], "question": f"What is {a} + {b} ?",
             "answer": a + b + offset, "solution": f"#### {a + b + offset}"} for a in range(3) for b in range(3)]
    return write_jsonl(path, rows)


@pytest.fixture
def hf(tmp_path):
    """An HF-mode config (chat prompts through a template file) and the alternative files of HF_CHANGES."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    (tmp_path / "t2.jinja").write_text("Q: " + TEMPLATE)
    other = {"model": write_checkpoint(tmp_path / "llama2", "What is + ? 0 1 2 3 4 5 6 7".split()),
             "data": write_prompts(tmp_path / "p2.jsonl", offset=1), "chat_template": str(tmp_path / "t2.jinja")}
    cfg = parse_args(["--preset=test", f"--model={write_checkpoint(tmp_path / 'llama')}",
                      f"--data={write_prompts(tmp_path / 'p.jsonl')}", f"--chat_template={tmp_path / 't.jinja'}",
                      "--max_new_tokens=10", "--eval_fraction=0.3"])
    return cfg, {k: other.get(k, v) for k, v in HF_CHANGES.items()}


def check_each_change(cfg, changes: dict, policy_fields=None):
    """policy_fields: those the policy's key depends on (default: every field read up to it, the task's too)."""
    policy_reads, all_reads = reads(cfg)
    policy_reads = policy_reads if policy_fields is None else policy_fields
    missing = all_reads - set(changes) - NOT_KEYED
    assert not missing, f"fields read into a warm-up key with no change to test: {missing}"
    base = keys(cfg)
    for field, value in changes.items():
        new = keys(dataclasses.replace(cfg, **{field: value}))
        assert new[1] != base[1], f"--{field}={value}: the draft warm-up's key did not change"
        if field in policy_reads:
            assert new[0] != base[0], f"--{field}={value}: the policy's key did not change"
        else:  # a draft-only setting leaves the policy's cache entry alone
            assert new[0] == base[0], f"--{field}={value}: the policy's key changed"


def test_builtin_every_field_read_changes_the_key():
    check_each_change(parse_args(["--preset=test"]), BUILTIN_CHANGES)


def test_hf_every_field_read_changes_the_key(hf):
    check_each_change(*hf, policy_fields={"model"})  # the checkpoint as is; the task enters the draft's key
    all_reads = reads(hf[0])[1]
    assert {"eval_fraction", "max_prompt_tokens", "chat_template", "data"} <= all_reads  # the held-out split's inputs
    assert keys(dataclasses.replace(hf[0], reward="docs.examples.concise_reward:concise")) == keys(hf[0])


@pytest.mark.parametrize("mode", ["builtin", "hf"])
def test_fields_no_warmup_reads_leave_the_keys_alone(mode, hf):
    cfg = parse_args(["--preset=test"]) if mode == "builtin" else hf[0]
    base = keys(cfg)
    for field, value in UNREAD.items():
        assert keys(dataclasses.replace(cfg, **{field: value})) == base, field


def test_hf_file_contents_at_the_same_path_change_the_key(hf, tmp_path):
    cfg, _ = hf
    base = keys(cfg)
    (tmp_path / "t.jinja").write_text("A: " + TEMPLATE)  # the template file's contents
    assert keys(cfg)[1] != base[1]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert keys(cfg) == base
    write_prompts(tmp_path / "p.jsonl", offset=2)  # the data file's contents: other answers
    assert keys(cfg)[1] != base[1]
    write_prompts(tmp_path / "p.jsonl")
    assert keys(cfg) == base


def other(value):
    """A different value of a spec field's type."""
    if isinstance(value, bool) or value is None:
        return padded_causal_attention if value is None else not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, ModelConfig):
        return dataclasses.replace(value, hidden_size=value.hidden_size * 2)
    if isinstance(value, tuple):
        return value + (0,)
    if isinstance(value, task.CountUpTask):
        return task.CountUpTask(1, 3)
    if callable(value):
        return padded_branch_attention if value is not padded_branch_attention else padded_causal_attention
    raise AssertionError(f"no other value for a {type(value).__name__}: add one to other()")


def specs():
    cfg = parse_args(["--preset=test"])
    tsk = build_task(cfg)
    return PolicySpec.from_config(cfg, tsk), draft_spec(cfg, tsk, "p")


@pytest.mark.parametrize("kind,field", [("policy", f.name) for f in dataclasses.fields(PolicySpec)]
                         + [("draft", f.name) for f in dataclasses.fields(DraftSpec)])
def test_every_spec_field_is_in_its_key(kind, field):
    spec = specs()[kind == "draft"]
    assert dataclasses.replace(spec, **{field: other(getattr(spec, field))}).key() != spec.key()


@pytest.mark.parametrize("path", ["harness/warmup.py", "harness/cache_keys.py", "tasks/task.py", "model.py",
                                  "modeling/layers.py", "draft.py", "draft_ttt.py", "draft_loss.py", "rl_loop.py",
                                  "speculative.py",
                                  "backends/attention_padded.py", "serving/hf_io.py"])
def test_an_edit_to_the_warmups_code_changes_both_keys(path, monkeypatch):
    cfg = parse_args(["--preset=test"])
    base, read = keys(cfg), cache_keys.module_source
    monkeypatch.setattr(cache_keys, "module_source",
                        lambda p: read(p) + ("\n# edited\n" if p == os.path.join(ROOT, path) else ""))
    new = keys(cfg)
    assert new[0] != base[0] and new[1] != base[1]


def test_the_code_in_the_key_is_the_warmups_not_the_harness():
    files = code_files(("harness.warmup", "tasks.task"))
    assert {"harness/warmup.py", "tasks/task.py", "model.py", "draft.py", "rl_loop.py"} <= set(files)
    assert not {"harness/config.py", "harness/experiment.py", "train.py", "dist_step.py", "pipeline.py"} & set(files)
    assert "tasks/hf_data.py" in code_files(("harness.warmup", "tasks.hf_task"))
    with pytest.raises(ValueError, match="roots=.*'nope' is not a module of the checkout"):
        code_files(("nope",))


def test_the_warmups_take_nothing_that_shapes_them_beside_their_spec():
    """Anything else a warm-up took as an argument would shape it without being in the key."""
    assert list(inspect.signature(warmup.warm_policy).parameters) == ["spec", "cache_dir", "log_every", "device",
                                                                      "chunk_mib", "group"]  # rounding only
    assert list(inspect.signature(warmup.warm_draft).parameters) == ["policy", "spec", "cache_dir", "log_every",
                                                                     "chunk_mib", "group"]


def test_cache_key_refuses_what_it_cannot_key_stably():
    assert cache_key({"b": 1, "a": (2, 3.5)}) == cache_key({"a": [2, 3.5], "b": 1})  # dict order, tuple vs list
    with pytest.raises(TypeError, match=r"part 0\['x'\] is a object; expected JSON data"):
        cache_key({"x": object()})  # its repr holds a memory address


def test_the_keys_are_the_same_in_a_fresh_process(hf, tmp_path):
    builtin = parse_args(["--preset=test"])
    code = ("import json, sys\nfrom harness.config import parse_args\nfrom harness.experiment import build_task, "
            "policy_key, draft_spec\nout = []\nfor argv in json.loads(sys.argv[1]):\n    cfg = parse_args(argv)\n"
            "    tsk = build_task(cfg)\n    pk = policy_key(cfg, tsk)\n"
            "    out.append([pk, draft_spec(cfg, tsk, pk).key()])\nprint(json.dumps(out))")
    cfg = hf[0]
    argvs = [["--preset=test"], ["--preset=test", f"--model={cfg.model}", f"--data={cfg.data}",
                                 f"--chat_template={cfg.chat_template}", "--max_new_tokens=10", "--eval_fraction=0.3"]]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "12345"}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == [list(keys(builtin)), list(keys(cfg))]
    assert keys(builtin) == keys(parse_args(["--preset=test"]))  # and twice in this one
