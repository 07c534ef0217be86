"""The second careful user's battery: bad input never destroys a run's files, a resume continues only the same run,
the servables are a pair, caches survive kills and concurrent runs, HF data mean what the user means, and every
failure is one line naming the file.

Each case calls the phase it is about in-process (the config check, the data load, the start of a run, the manifest
check, the export check, a warm-up's cache), with a tiny HF checkpoint built here; one short HF-mode run (--preset
test, 1 step) and two subprocesses for train.py's one-line exits. Adds ~35 s on 2 busy cores (measured with
`timeout 900 python -m pytest -q tests/test_bad_inputs2.py --durations=5`).
"""
import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from checkpoints import checkpoint
from checkpoints.checkpoint import capture_rng, latest_checkpoint, load_checkpoint, save_checkpoint
from checkpoints.resume_policy import NoCheckpointError, check_resumable, checkpoint_to_resume, start_run
from harness import warmup
from harness.cache_keys import PolicySpec
from harness.config import parse_args
from hf_util import write_jsonl, write_tiny_llama
from model import ModelConfig, Transformer
from serving import export
from serving.hf_io import from_pretrained, save_pretrained
from tasks.hf_data import load_examples
from tasks.hf_task import HFTask, math_answer_reward
from tasks.protocol import make_task
from test_cache_keys import TEMPLATE, hf, keys  # noqa: F401 -- hf is a fixture
from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEAD = 2 ** 30  # a pid no process has (above Linux's pid_max)
ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(3) for b in range(3)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("hf") / "llama", extra_vocab=0,
                                words="What is + ? 0 1 2 3 4 5".split()))


def _tree(folder) -> dict:
    """{relative path: bytes} of every file under `folder`: what a refused run must leave as it was."""
    return {os.path.relpath(os.path.join(r, f), folder): open(os.path.join(r, f), "rb").read()
            for r, _, files in os.walk(folder) for f in files}


def _hf_cfg(llama, data, out, *extra):
    return parse_args(["--preset=test", f"--model={llama}", f"--data={data}", "--max_new_tokens=4",
                       "--eval_fraction=0.3", f"--out={out}", f"--cache_dir={out.parent / 'cache'}", *extra])


def _earlier_run(out, cfg, step=2):
    """<out> as a run with checkpoints left it: ckpt/step_<step>, 7 metric records, a summary and both servables."""
    records = [{"kind": k, "step": s} for s in range(1, 5) for k in ("train", "eval")][:7]
    save_checkpoint(out / "ckpt", step, states={}, rng=capture_rng(), metrics=records[:step], mesh=(1, 1, 1),
                    config=dataclasses.asdict(cfg), inputs=_inputs(cfg))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "summary.json").write_text("{}")
    for name in ("policy", "draft"):
        (out / name).mkdir()
        (out / name / "config.json").write_text("{}")


def _inputs(cfg):
    from checkpoints.inputs import input_fingerprints  # new module: imported here so the old code fails per case
    return input_fingerprints(dataclasses.asdict(cfg))


# ------------------------------------------------------------------------------- 2. validate before destroying
def test_overwrite_with_a_bad_data_row_leaves_out_as_it_was(llama, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "run"
    _earlier_run(out, _hf_cfg(llama, data, out))
    with open(data, "a") as f:
        f.write('{"prompt": "What is 1 + 1 ?"}\n')  # no answer
    before = _tree(out)
    with pytest.raises(ValueError, match=r"p.jsonl:10: missing field 'answer'"):
        train(_hf_cfg(llama, data, out, "--overwrite"))
    assert _tree(out) == before  # ckpt/ not deleted, metrics.jsonl not truncated


def test_resume_after_a_bad_row_was_appended_keeps_every_metric_record(llama, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "run"
    _earlier_run(out, _hf_cfg(llama, data, out))
    with open(data, "a") as f:
        f.write('{"prompt": "What is 1 + 1 ?", "solution": 2}\n')
    before = _tree(out)
    with pytest.raises(ValueError, match=r"p.jsonl:10: missing field 'answer'"):
        train(_hf_cfg(llama, data, out, "--resume", "--resume_changed_inputs"))
    assert _tree(out) == before and len((out / "metrics.jsonl").read_text().splitlines()) == 7


def test_a_resume_keeps_the_records_after_its_checkpoint_in_earlier(tmp_path):
    cfg = parse_args(["--preset=test", f"--out={tmp_path}"])
    _earlier_run(tmp_path, cfg, step=2)
    path, notes = start_run(tmp_path, dataclasses.asdict(dataclasses.replace(cfg, resume=True)), (1, 1, 1))
    assert path.name == "step_000002" and any("kept the records after step 2" in n for n in notes)
    assert len((tmp_path / "earlier-1" / "metrics.jsonl").read_text().splitlines()) == 7


def test_a_fresh_run_keeps_servables_tb_and_wandb_in_earlier(tmp_path):
    for name in ("policy", "draft", "tb", "wandb"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    (tmp_path / "summary.json").write_text("{}")
    start_run(tmp_path, dataclasses.asdict(parse_args(["--preset=test"])), (1, 1, 1))
    assert sorted(os.listdir(tmp_path)) == ["earlier-1"]
    assert sorted(os.listdir(tmp_path / "earlier-1")) == ["draft", "policy", "summary.json", "tb", "wandb"]


def _pair(n_layers=6, seed=0):
    from draft import Eagle3Draft
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=n_layers))
    return policy, Eagle3Draft.from_target(policy)


@pytest.mark.parametrize("left", ["old+tmp", "old", "tmp beside draft"])
def test_an_interrupted_export_swap_is_recovered_at_the_next_start(tmp_path, left):
    policy, draft = _pair()
    export.write_servables(str(tmp_path / "x"), policy, draft, step=1)
    d = tmp_path / "draft"
    if left == "tmp beside draft":  # killed while writing the new export: the old one stands, the temp is junk
        shutil.copytree(tmp_path / "x" / "draft", d)
    if "old" in left:  # killed between rename(draft -> draft.old) and rename(draft.tmp -> draft)
        shutil.copytree(tmp_path / "x" / "draft", tmp_path / f"draft.old{DEAD}")
    if "tmp" in left:
        shutil.copytree(tmp_path / "x" / "draft", tmp_path / f"draft.tmp{DEAD}")
    shutil.rmtree(tmp_path / "x")
    notes = start_run(tmp_path, dataclasses.asdict(parse_args(["--preset=test"])), (1, 1, 1))[1]
    kept = tmp_path / "earlier-1" / "draft"  # a fresh run moves the earlier servables aside
    assert (kept / "model.safetensors").is_file(), notes
    assert not [n for p in (tmp_path, tmp_path / "earlier-1") for n in os.listdir(p) if ".old" in n or ".tmp" in n]


# ------------------------------------------------------------------------------ 3. resume continues only its run
def _resume_cfg(cfg, **kw):
    return dataclasses.asdict(dataclasses.replace(cfg, resume=True, **kw))


def test_resume_refuses_changed_data_or_weights_naming_them(llama, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(llama, model)
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "run"
    cfg = _hf_cfg(str(model), data, out)
    _earlier_run(out, cfg)
    path = out / "ckpt" / "step_000002"
    check_resumable(path, _resume_cfg(cfg), (1, 1, 1))  # the same bytes: resumes
    write_jsonl(tmp_path / "p.jsonl", [{**r, "answer": r["answer"] + 1} for r in ROWS])  # other answers
    with pytest.raises(ValueError, match=r"--data=.*p.jsonl: its contents changed since the checkpoint .*"
                                         r"add --resume_changed_inputs"):
        check_resumable(path, _resume_cfg(cfg), (1, 1, 1))
    check_resumable(path, _resume_cfg(cfg, resume_changed_inputs=True), (1, 1, 1))  # told explicitly: allowed
    write_jsonl(tmp_path / "p.jsonl", ROWS)
    sd = {k: v + 0.01 for k, v in from_pretrained(str(model)).state_dict().items()}
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})  # other weights, same path
    with pytest.raises(ValueError, match=r"--model=.*llama: model.safetensors changed since the checkpoint"):
        check_resumable(path, _resume_cfg(cfg), (1, 1, 1))


def test_a_hand_edited_manifest_cannot_resume_another_config(tmp_path):
    cfg = parse_args(["--preset=test"])
    path = save_checkpoint(tmp_path / "ckpt", 2, states={}, rng=capture_rng(), config=dataclasses.asdict(cfg),
                           mesh=(1, 1, 1))
    m = json.loads((path / "MANIFEST.json").read_text())
    m["config"]["lr"] = 0.1
    (path / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_000002: .*sha256 does not match its contents"):
        with pytest.raises(NoCheckpointError, match="damaged or incomplete"):
            checkpoint_to_resume(tmp_path / "ckpt")


def test_manifest_file_names_stay_inside_the_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", 1, states={}, rng=capture_rng())
    secret = tmp_path / "secret"
    secret.write_text("not the checkpoint's")
    m = json.loads((path / "MANIFEST.json").read_text())
    m["files"]["../../secret"] = {"bytes": secret.stat().st_size, "sha256": checkpoint._sha256(secret)}
    (path / "MANIFEST.json").write_text(json.dumps(checkpoint.seal(m) if hasattr(checkpoint, "seal") else m))
    with pytest.warns(UserWarning, match=r"lists '../../secret': expected meta.pt and rank<NNNNN>.pt inside"):
        assert latest_checkpoint(tmp_path / "ckpt") is None


# ---------------------------------------------------------------------------------- 4. servables come as a pair
def test_a_policy_that_cannot_export_a_draft_removes_the_old_draft(tmp_path):
    export.write_servables(str(tmp_path), *_pair(6))
    w = export.write_servables(str(tmp_path), *_pair(2), require_draft=False)  # 2 layers: no 3 taps
    assert w["draft"] is None and not (tmp_path / "draft").exists()


def test_check_export_refuses_a_draft_beside_another_steps_policy(tmp_path):
    policy, draft = _pair()
    export.write_servables(str(tmp_path / "a"), policy, draft, step=1)
    export.check_export(str(tmp_path / "a" / "draft"))  # one export: a pair
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # step 2's policy
    export.write_servables(str(tmp_path / "b"), policy, draft, step=2)
    shutil.rmtree(tmp_path / "a" / "policy")  # killed between the two exports of step 2
    shutil.copytree(tmp_path / "b" / "policy", tmp_path / "a" / "policy")
    with pytest.raises(ValueError, match=r"the draft \(step 1\) was exported beside another policy than .*policy "
                                         r"\(step 2\): the pair does not match"):
        export.check_export(str(tmp_path / "a" / "draft"))


# ------------------------------------------------------------------ 6. caches safe under kills and concurrency
@pytest.fixture
def spec():
    cfg = parse_args(["--preset=test", "--sft_steps=1", "--sft_batch=2"])
    return PolicySpec.from_config(cfg, make_task(cfg.task, cfg))


def _leftovers(cache) -> list:
    return [n for n in os.listdir(cache) if ".tmp" in n or ".old" in n]


def test_an_incomplete_cache_entry_is_rebuilt_without_a_copy_left(tmp_path, spec):
    entry = tmp_path / f"policy-{spec.key()}"
    entry.mkdir()
    (entry / "model.safetensors").write_bytes(b"half a copy")  # an interrupted copy: no config.json
    (tmp_path / f"policy-{spec.key()}.tmp{DEAD}").mkdir()  # a killed run's temporary
    _, _, loaded = warmup.warm_policy(spec, cache_dir=str(tmp_path))
    assert not loaded and (entry / "config.json").is_file() and _leftovers(tmp_path) == []
    assert warmup.warm_policy(spec, cache_dir=str(tmp_path))[2]  # now it loads


def test_a_concurrent_run_finishing_first_leaves_no_temporary(tmp_path, spec, monkeypatch):
    real = warmup.sft_policy

    def sft_while_another_run_publishes(policy, *a, **k):  # the other run's entry lands while this one trains
        save_pretrained(Transformer(spec.model), str(tmp_path / f"policy-{spec.key()}"))
        return real(policy, *a, **k)
    monkeypatch.setattr(warmup, "sft_policy", sft_while_another_run_publishes)
    warmup.warm_policy(spec, cache_dir=str(tmp_path))
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------------ 7. HF data parsed as the user means
@pytest.mark.parametrize("answer, response", [(1e-6, "so it is 0.000001"), (1e20, "\\boxed{100000000000000000000}"),
                                              (1e20, "the answer is 1e20"), (0.0025, "#### 2.5e-3"),
                                              ("1.5E+3", "1500")])
def test_numeric_answers_compare_as_numbers_with_exponents(tmp_path, answer, response):
    ex = load_examples(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "answer": answer}]))
    assert math_answer_reward(response, ex[0].answer) == 1.0
    assert math_answer_reward("the answer is 2", ex[0].answer) == 0.0


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_inf_answers_are_refused_naming_the_line(tmp_path, value):
    path = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "a", "answer": 1}', f'{{"prompt": "b", "answer": {value}}}'])
    with pytest.raises(ValueError, match=r"p.jsonl:2: 'answer' is -?(nan|inf): expected a finite number"):
        load_examples(path)


def test_one_prompt_with_two_answers_is_refused(llama, tmp_path):
    same = write_jsonl(tmp_path / "s.jsonl", ROWS + [{"prompt": "What is 0 + 1 ?", "answer": "1.0"}])
    HFTask(llama, same, max_new_tokens=8)  # the same answer written otherwise: fine
    bad = write_jsonl(tmp_path / "b.jsonl", ROWS + [{"prompt": "What is 0 + 1 ?", "answer": 2}])
    with pytest.raises(ValueError, match=r"b.jsonl:10: the same prompt as line 2 with another answer \('2' vs '1'\)"):
        HFTask(llama, bad, max_new_tokens=8)


def test_gzip_data_is_read_and_a_broken_one_named(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in ROWS)
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert [e.answer for e in load_examples(str(tmp_path / "p.jsonl.gz"))] == [str(r["answer"]) for r in ROWS]
    (tmp_path / "cut.jsonl").write_bytes(gzip.compress(text.encode())[:40])  # gzip whatever the name
    with pytest.raises(ValueError, match=r"cut.jsonl: unreadable gzip file"):
        load_examples(str(tmp_path / "cut.jsonl"))


def test_non_utf8_data_names_the_file_and_line(tmp_path):
    (tmp_path / "l.jsonl").write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_examples(str(tmp_path / "l.jsonl"))


def test_answer_key_with_a_dot_reads_a_literal_field_and_says_how_it_reached_in(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "a.b": 7}])
    assert load_examples(path, answer_key="a.b")[0].answer == "7"
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "q", "a": {"c": 7}}])
    with pytest.raises(ValueError, match=r"missing field 'a.b' \(--answer_key; the row's fields: \['a', 'prompt'\]; "
                                         r"reaching in, 'a' has no field 'b'\)"):
        load_examples(path, answer_key="a.b")


# --------------------------------------------------------------------------- 8. one-line errors naming the file
def _draft_entry(tmp_path, spec, damage):
    """A cached draft for a tiny policy, at the entry warm_draft reads, then damaged."""
    from draft import Eagle3Draft
    from harness.cache_keys import DraftSpec
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny"))
    dspec = DraftSpec("pk", spec.task, 1, 2, 1e-3, 2, 4, 1, 0, 0)
    entry = tmp_path / f"draft-{dspec.key()}"
    Eagle3Draft.from_target(policy).save(str(entry))
    damage(entry)
    return policy, dspec


def _truncate(e):
    (e / "model.safetensors").write_bytes((e / "model.safetensors").read_bytes()[:-64])


def _foreign(e):
    save_file({"w": torch.ones(2)}, str(e / "model.safetensors"))


def _extra_key(e):
    (e / "config.json").write_text(json.dumps({**json.loads((e / "config.json").read_text()), "colour": "red"}))


def _bad_json(e):
    (e / "config.json").write_text('{"vocab_size": 97,')


def _nan(e):
    from safetensors.torch import load_file
    sd = load_file(str(e / "model.safetensors"))
    sd["fc.weight"][0, 0] = float("nan")
    save_file(sd, str(e / "model.safetensors"))


@pytest.mark.parametrize("damage, message", [
    (_truncate, r"model.safetensors: unreadable cached draft \(SafetensorError"),
    (_foreign, r"model.safetensors: unreadable cached draft \(KeyError"),
    (_extra_key, r"config.json: unknown key\(s\) \['colour'\]"),
    (_bad_json, r"config.json: invalid JSON \(.* at line 1, column \d+\)"),
    (_nan, r"model.safetensors: the weights are not finite \(fc.weight\)"),
])
def test_a_damaged_cached_draft_is_one_line_naming_the_file(tmp_path, spec, damage, message):
    policy, dspec = _draft_entry(tmp_path, spec, damage)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + r"/draft-\w+/" + message) as e:
        warmup.warm_draft(policy, dspec, cache_dir=str(tmp_path))
    assert "\n" not in str(e.value)


def test_nan_weights_in_a_policy_or_a_checkpoint_name_the_file(tmp_path, spec):
    policy = Transformer(spec.model)
    with torch.no_grad():
        policy.lm_head.weight[3, 1] = float("inf")
    save_pretrained(policy, str(tmp_path / f"policy-{spec.key()}"))  # a cached policy, or a --model directory
    with pytest.raises(ValueError, match=r"policy-\w+/model.safetensors: tensor 'lm_head.weight' holds NaN or inf"):
        warmup.warm_policy(spec, cache_dir=str(tmp_path))
    path = save_checkpoint(tmp_path / "ckpt", 1, states={"policy": {"w": torch.tensor([1.0, float("nan")])}},
                           rng=capture_rng())
    with pytest.raises(ValueError, match=r"step_000001/rank00000.pt: the weights are not finite \(states\['policy'\]"):
        load_checkpoint(path)


def test_the_config_check_refuses_an_impossible_or_read_only_out_or_cache_dir(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--cache_dir=.*file/sub: expected a directory this process can write"):
        parse_args([f"--cache_dir={tmp_path / 'file' / 'sub'}"])
    ro = str(tmp_path / "ro")
    os.mkdir(ro)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == ro else real(p, mode))  # root ignores chmod
    with pytest.raises(ValueError, match=r"--out=.*ro/run: expected a directory \(''"):
        parse_args([f"--out={ro}/run"])
    with pytest.raises(ValueError, match=r"--cache_dir=.*ro: expected a directory this process can write"):
        parse_args([f"--cache_dir={ro}"])


def test_log_wandb_without_wandb_is_a_config_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"--log=wandb: expected a comma list of jsonl, tensorboard, wandb, each "
                                         r"installed \(pip install"):
        parse_args(["--log=wandb"])


FAIL = """
import runpy, sys
sys.path.insert(0, {root!r})
import harness.experiment as e
def build(*a, **k):
    raise {error}
e.build = build
sys.argv = ["train.py", "--preset=test", "--out={out}", "--cache_dir={out}/cache"]
runpy.run_path({root!r} + "/train.py", run_name="__main__")
"""


@pytest.mark.parametrize("error, line", [
    ("OSError(28, 'No space left on device', 'out/ckpt/x')", "train.py: [Errno 28] No space left on device: "
                                                            "'out/ckpt/x'"),
    ("FloatingPointError('step 3: loss_policy = nan (not finite); stopping')",
     "train.py: step 3: loss_policy = nan (not finite); stopping"),
])
def test_a_full_disk_or_a_nan_loss_ends_in_one_line(tmp_path, error, line):
    entry = tmp_path / "fail.py"
    entry.write_text(FAIL.format(root=ROOT, error=error, out=tmp_path / "run"))
    r = subprocess.run([sys.executable, str(entry)], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == line, r.stderr[-2000:]


# ------------------------------------------------------------- reports, and the stale-cache cases (cache keys)
def test_one_step_hf_run_reports_none_acceptance_and_the_prompts_it_evaluated(llama, tmp_path):
    """--max_new_tokens 1: no verification forward, acceptance "none"; --eval_prompts 500 of 3 held out: said in the
    summary; the 2-layer policy exports no draft, so the earlier run's draft/ is kept in earlier-1/, not beside it."""
    out = tmp_path / "run"
    for name in ("policy", "draft", "tb"):
        (out / name).mkdir(parents=True)
        (out / name / "f").write_text(name)
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    summary = train(_hf_cfg(llama, data, out, "--steps=1", "--max_new_tokens=1", "--eval_prompts=500",
                            "--frozen_arm"))
    assert summary["eval_prompts"] == 3 and "--eval_prompts=500" in summary["eval_prompts_note"]
    assert summary["accept_len_cotrained"] is None and summary["accept_len_frozen"] is None
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["accept_cotrained"] is None for r in records if r["kind"] == "eval")
    assert [r["accept_len"] for r in records if r["kind"] == "train"] == [None]
    assert sorted(os.listdir(out / "earlier-1")) == ["draft", "policy", "tb"] and not (out / "draft").exists()
    assert json.loads((out / "policy" / "servable.json").read_text())["step"] == 1


@pytest.mark.parametrize("field, value", [("eval_fraction", 0.4), ("max_prompt_tokens", 50)])
def test_the_held_out_split_is_in_the_draft_warmups_key(hf, field, value):  # noqa: F811 -- the fixture
    cfg, _ = hf
    assert keys(dataclasses.replace(cfg, **{field: value}))[1] != keys(cfg)[1]


def test_the_chat_template_files_contents_are_in_the_key(hf, tmp_path):  # noqa: F811
    cfg, _ = hf
    base = keys(cfg)
    (tmp_path / "t.jinja").write_text("A: " + TEMPLATE)  # the same --chat_template path, other contents
    assert keys(cfg)[1] != base[1]
