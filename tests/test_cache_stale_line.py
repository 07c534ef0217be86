"""A warm-up that misses its cache because its code changed says which file did (harness/cache_keys.stale_line).

Each cached entry records its settings-only hash and the sha256 of each source file it was built from (code.json);
on a miss, an entry of the same settings whose recorded code differs is named with exactly the differing files. An
entry without the record (cached before records were kept), or one of other settings, gives no line. Also through
warm_policy itself (SFT stubbed out: the record is written on publish, the line printed on the next miss).
~3 s of test time on a shared 2-core CPU (5 tests), plus the imports.
"""
import dataclasses
import json
import os
import shutil

from harness import cache_keys, warmup
from harness.cache_keys import CODE_RECORD, PolicySpec, code_record, read_record, stale_line, write_record
from harness.config import parse_args
from harness.experiment import build_task, draft_spec


def specs(policy_key: str = "p"):
    cfg = parse_args(["--preset=test"])
    tsk = build_task(cfg)
    return PolicySpec.from_config(cfg, tsk), draft_spec(cfg, tsk, policy_key)


def entry(cache, name: str, rec: dict | None) -> str:
    path = os.path.join(cache, name)
    os.makedirs(path)
    if rec is not None:
        write_record(path, rec)
    return path


def edited(rec: dict, *files) -> dict:
    """rec as if it had been built from other versions of `files`."""
    return {**rec, "code": {p: ("0" * 64 if p in files else h) for p, h in rec["code"].items()}}


def test_the_line_names_exactly_the_changed_files(tmp_path):
    spec = specs()[0]
    rec = code_record("policy", spec, str(tmp_path))
    assert {"model.py", "draft.py", "harness/warmup.py"} <= set(rec["code"])
    entry(tmp_path, "policy-old1", edited(rec, "model.py"))
    line = stale_line("policy SFT warm-up", "policy", spec, str(tmp_path))
    assert line == f"policy SFT warm-up: retraining: model.py changed since {tmp_path / 'policy-old1'}"
    entry(tmp_path, "policy-old2", edited(rec, "draft.py", "speculative.py"))  # the entry closest to now is named
    assert stale_line("x", "policy", spec, str(tmp_path)).startswith("x: retraining: model.py changed")


def test_no_line_without_a_record_or_for_other_settings(tmp_path):
    spec = specs()[0]
    rec = code_record("policy", spec, str(tmp_path))
    entry(tmp_path, "policy-legacy", None)  # an entry cached before records were kept
    os.makedirs(tmp_path / "policy-bad")
    (tmp_path / "policy-bad" / CODE_RECORD).write_text("not json")
    assert read_record(str(tmp_path / "policy-bad")) is None
    other = dataclasses.replace(spec, steps=spec.steps + 1)
    entry(tmp_path, "policy-other", edited(code_record("policy", other, str(tmp_path)), "model.py"))
    assert stale_line("x", "policy", spec, str(tmp_path)) is None
    entry(tmp_path, "draft-same", edited(rec, "model.py"))  # another warm-up's entry is not this one's
    assert stale_line("x", "policy", spec, str(tmp_path)) is None
    assert stale_line("x", "policy", spec, str(tmp_path / "absent")) is None


def test_a_draft_names_the_file_though_its_policy_key_changed_with_it(tmp_path):
    pol = specs()[0]
    entry(tmp_path, "policy-k1", edited(code_record("policy", pol, str(tmp_path)), "model.py"))
    entry(tmp_path, "policy-k2", code_record("policy", pol, str(tmp_path)))  # retrained after the edit
    old = specs("k1")[1]
    entry(tmp_path, "draft-d1", edited(code_record("draft", old, str(tmp_path)), "model.py"))
    new = specs("k2")[1]
    assert stale_line("draft warm-up", "draft", new, str(tmp_path)) == \
        f"draft warm-up: retraining: model.py changed since {tmp_path / 'draft-d1'}"
    assert stale_line("d", "draft", specs("k3")[1], str(tmp_path)) is None  # a policy without a record


def test_warm_policy_records_its_code_and_prints_the_line_on_a_miss(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(warmup, "sft_policy", lambda *a, **k: None)  # the SFT itself is not what is tested
    spec = specs()[0]
    _, key, loaded = warmup.warm_policy(spec, cache_dir=str(tmp_path))
    path = tmp_path / f"policy-{key}"
    rec = read_record(str(path))
    assert not loaded and rec == code_record("policy", spec, str(tmp_path))
    assert "retraining" not in capsys.readouterr().out  # an empty cache: nothing to name
    _, _, loaded = warmup.warm_policy(spec, cache_dir=str(tmp_path))
    assert loaded  # the record beside the weights does not disturb loading
    shutil.move(str(path), str(tmp_path / "policy-before"))
    (tmp_path / "policy-before" / CODE_RECORD).write_text(json.dumps(edited(rec, "rl_loop.py")))
    warmup.warm_policy(spec, cache_dir=str(tmp_path))
    assert capsys.readouterr().out.strip() == \
        f"policy SFT warm-up: retraining: rl_loop.py changed since {tmp_path / 'policy-before'}"


def test_a_file_added_to_the_code_is_named(tmp_path):
    spec = specs()[0]
    rec = code_record("policy", spec, str(tmp_path))
    entry(tmp_path, "policy-old", {**rec, "code": {p: h for p, h in rec["code"].items() if p != "draft_loss.py"}})
    assert stale_line("x", "policy", spec, str(tmp_path)) == \
        f"x: retraining: draft_loss.py changed since {tmp_path / 'policy-old'}"
    assert cache_keys.module_path("draft_loss")  # the name is a real source file of the checkout
