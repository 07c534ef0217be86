"""The third careful user's battery: the planning tools refuse nonsense instead of predicting from it, every entry point
ends in one line naming the file, flag or field (a traceback only with COSPEC_TRACEBACK=1), a full disk and Ctrl-C
end cleanly, a `--draft` export is checked as `--model` is, and `--help` and the checks agree on every flag.

Each case calls the entry point's main in-process through parallel.cli.run_main (what `python -m ...` runs) and reads
its exit code and stderr; the planning tools' configs are tiny JSON files and the exports a 6-layer `tiny` pair built
here; one case sends a real SIGINT to train.py in a subprocess. Adds ~8 s to the suite on 2 busy cores (~6 s of it
that subprocess; `timeout 600 python -m pytest -q tests/test_bad_inputs3.py --durations=5`).
"""
import dataclasses
import functools
import json
import os
import re
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import train
from checkpoints.checkpoint import capture_rng, save_checkpoint
from harness import cost_check, cost_model, memory_plan, warmup
from harness.draft_formats import load_draft
from harness.config import CHECKS, Config, help_text, parse_args
from model import ModelConfig, Transformer
from parallel.cli import TRACEBACK, field_docs, run_main
from serving import export
from test_layout import ROOT

QWEN = os.path.join(ROOT, "docs", "examples", "qwen3_8b", "config.json")
FULL_DISK = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def ends(main, file, argv, capsys, code=1) -> str:
    """Run an entry point as `python -m` does; assert it exits `code` with exactly one line on stderr, no traceback.
    -> that line."""
    with pytest.raises(SystemExit) as e:
        run_main(main, file, argv)
    err = capsys.readouterr().err
    assert e.value.code == code and err.count("\n") == 1 and "Traceback" not in err, (e.value.code, err)
    return err.strip()


def config_json(tmp_path, name="c.json", drop=(), **changes) -> str:
    """Qwen3-8B's config.json with `changes` (None: written as null) and the keys in `drop` removed."""
    cfg = {k: v for k, v in {**json.load(open(QWEN)), **changes}.items() if k not in drop}
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


# -------------------------------------------------------------- 1. silently wrong: configs checked for every reader
ABSURD = [  # (config.json changes, the field and what was expected)
    ({"num_hidden_layers": -4}, "num_hidden_layers=-4: expected an integer >= 1"),
    ({"vocab_size": 0}, "vocab_size=0: expected an integer >= 1"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: expected an integer >= 1"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "hidden_size": 32, "head_dim": None},
     "hidden_size=32: expected a multiple of num_attention_heads=5"),
]


@pytest.mark.parametrize("changes, message", ABSURD)
@pytest.mark.parametrize("tool", ["cost_model", "memory_plan"])
def test_the_planning_tools_refuse_an_absurd_model_naming_the_field(tmp_path, capsys, tool, changes, message):
    """Was: cost_model printed "rollout speedup -1.743x" for -4 layers, memory_plan said 0 heads "fits"."""
    mod = {"cost_model": cost_model, "memory_plan": memory_plan}[tool]
    line = ends(mod.main, mod.__file__, ["--model", config_json(tmp_path, **changes)], capsys)
    assert line.startswith(f"harness.{tool}: {tmp_path}/c.json: ") and message in line


@pytest.mark.parametrize("kw, message", [
    (dict(num_attention_heads=0), "num_attention_heads=0: expected an integer >= 1"),
    (dict(num_attention_heads=5, hidden_size=32, num_key_value_heads=5), "hidden_size=32: expected a multiple of "
                                                                        "num_attention_heads=5"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3: expected a divisor of num_attention_heads=4"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0: expected an integer >= 1"),
    (dict(vocab_size=0), "vocab_size=0: expected an integer >= 1"),
    (dict(intermediate_size=-1), "intermediate_size=-1: expected an integer >= 1"),
    (dict(head_dim=7), "head_dim=7: expected an even integer >= 2"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0: expected a number > 0"),
])
def test_model_config_refuses_each_bad_field_in_one_line(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        ModelConfig(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--dp=-2"], "--dp=-2: expected an integer >= 1"),  # was: a mesh with dp -2 and negative step times
    (["--rows", "0"], "--rows=0: expected an integer >= 1"),  # was: 0 == False, replaced by the default
    (["--alpha", "1.5"], "--alpha=(1.5,): expected per-position acceptances in [0, 1]"),
    (["--updates", "0"], "--updates=0: expected an integer >= 1"),
    (["--tail", "0.5"], "--tail=0.5: expected a finite number >= 1"),
    (["--draft_share", "2"], "--draft_share=2.0: expected in [0, 1]"),
    (["--flops=-1"], "--flops=-1.0: expected a finite number >= 0"),
    (["--draft_vocab", "100"], "--draft_vocab=100: expected <= the policy's vocabulary, 64"),
])
def test_cost_model_flags_out_of_range_are_refused(capsys, argv, message):
    assert message in ends(cost_model.main, cost_model.__file__, argv, capsys)


def test_cost_model_takes_zero_as_a_value(capsys):
    """--k 0 is autoregressive rollouts (was: dropped as unset, k = 4 predicted)."""
    assert cost_model.main(["--k", "0"]) == 0
    out = capsys.readouterr().out
    assert "k 0, E[kept] 1.000" in out and "speedup" not in out


# ------------------------------------------------------------------------------ 2. one line for every entry point
@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/none.json"], "--model={tmp}/none.json: expected a preset"),
    (["--model", "{tmp}/bad.json"], "{tmp}/bad.json: invalid JSON (Expecting ',' delimiter at line 1"),
    (["--model", "{tmp}/nokey.json"], "{tmp}/nokey.json: missing key 'num_attention_heads'"),
    (["--gpus", "3"], "--gpus=3: expected pp x cp x dp = 2 x 2 x dp GPUs"),
    (["--gpus=-1"], "--gpus=-1: expected >= 0"),
    (["--pp", "0"], "--pp=0: expected >= 1"),
    (["--device_gib", "0"], "--device_gib=0: expected a finite number > 0"),
    (["--seq", "100", "--max_new_tokens", "200"], "--seq=100: expected more tokens than --max_new_tokens=200"),
    (["--model", "{tmp}/c.json", "--tap_layers", "0,1"], "--tap_layers=0,1: expected 3 layer ids"),
    (["--zero1", "maybe"], "--zero1=maybe: expected true, false or auto"),
    (["--recommend", "x"], "--recommend='x': expected true or false"),
])
def test_memory_plan_refusals_are_one_line(tmp_path, capsys, argv, message):
    config_json(tmp_path)
    (tmp_path / "bad.json").write_text('{"vocab_size": 97 "hidden_size": 32}')
    config_json(tmp_path, "nokey.json", drop=("num_attention_heads",))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert message.format(tmp=tmp_path) in ends(memory_plan.main, memory_plan.__file__, argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/none.json"], "--model='{tmp}/none.json': expected a model preset"),
    (["--model", "{tmp}/bad.json"], "{tmp}/bad.json: invalid JSON"),
    (["--model", "{tmp}/nokey.json"], "{tmp}/nokey.json: missing key(s) ['vocab_size']"),
    (["--device", "{tmp}/bad.json"], "{tmp}/bad.json: invalid JSON"),
    (["--device", "{tmp}/dev.json"], "{tmp}/dev.json: F=-1: expected a number > 0"),
])
def test_cost_model_refusals_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text("{")
    config_json(tmp_path, "nokey.json", drop=("vocab_size",))
    (tmp_path / "dev.json").write_text(json.dumps({"F": -1, "BW": 1e9}))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert message.format(tmp=tmp_path) in ends(cost_model.main, cost_model.__file__, argv, capsys)


def test_a_flag_of_the_wrong_type_is_one_line_naming_it(capsys):
    """argparse's own refusals too (was: the usage block, then the error)."""
    line = ends(cost_model.main, cost_model.__file__, ["--dp", "x"], capsys, code=2)
    assert line == "harness.cost_model: argument --dp: invalid int value: 'x'"


def test_cost_check_names_the_file_and_line_of_a_garbage_record(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train"}\nnot json\n')
    line = ends(cost_check.main, cost_check.__file__, [str(tmp_path)], capsys)
    assert f"{tmp_path}/metrics.jsonl:2: invalid JSON (Expecting value at column 1)" in line


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    """<dir>/policy + <dir>/draft written by write_servables for a 6-layer tiny policy."""
    from draft import Eagle3Draft
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=6))
    out = tmp_path_factory.mktemp("servables")
    export.write_servables(str(out), policy, Eagle3Draft.from_target(policy), step=1)
    return out, policy


def _copy(servables, tmp_path) -> tuple:
    shutil.copytree(servables[0], tmp_path / "run")
    return tmp_path / "run", servables[1]


def _truncate(d):
    (d / "draft" / "model.safetensors").write_bytes((d / "draft" / "model.safetensors").read_bytes()[:-64])


def _other_pair(d):  # the policy of another step beside the draft
    sd = load_file(str(d / "policy" / "model.safetensors"))
    save_file({k: v + 1 for k, v in sd.items()}, str(d / "policy" / "model.safetensors"))


@pytest.mark.parametrize("damage, target, message", [
    (lambda d: None, "missing", "{d}/missing: expected an exported draft folder"),
    (_truncate, "draft", "{d}/draft/model.safetensors: unreadable safetensors file"),
    (lambda d: None, "policy", "{d}/policy/config.json: architectures=['LlamaForCausalLM']: expected a draft's "
                               "(LlamaForCausalLMEagle3, DFlashDraftModel, a speculators config"),
    (_other_pair, "draft", "the draft (step 1) was exported beside another policy than {d}/policy"),
])
def test_serving_export_refusals_are_one_line(servables, tmp_path, capsys, damage, target, message):
    d, _ = _copy(servables, tmp_path)
    damage(d)
    line = ends(export.main, export.__file__, [str(d / target)], capsys)
    assert line.startswith("serving.export: ") and message.format(d=d) in line


@pytest.mark.parametrize("entry, argv, message", [
    ("train", ["--temperature", "0"], "train.py: --temperature=0: expected > 0 (GRPO needs G different samples"),
    ("train", ["--cold_arm", "x"], "train.py: --cold_arm=x: expected true, false or auto"),  # was: names no flag
    ("warmup", ["--model={tmp}", "--data={tmp}/p.jsonl"], "harness.warmup: model='{tmp}': no tokenizer.json"),
    ("hf_io", ["{tmp}"], "serving.hf_io: path='{tmp}': expected an HF checkpoint directory with config.json"),
    ("report", ["{tmp}"], "harness.report: [Errno 2] No such file or directory: '{tmp}/summary.json'"),
])
def test_the_other_entry_points_end_in_one_line(tmp_path, capsys, entry, argv, message):
    from harness import report
    from serving import hf_io
    mod = {"train": train, "warmup": warmup, "hf_io": hf_io, "report": report}[entry]
    main = functools.partial(warmup.main, dev=torch.device("cpu")) if entry == "warmup" else mod.main
    argv = [a.format(tmp=tmp_path) for a in argv]
    if entry == "warmup":  # its main takes the parsed Config (harness.config is not the warm-ups' code)
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "p.jsonl").write_text("")
        argv = parse_args(argv)
    line = ends(main, mod.__file__, argv, capsys)
    assert line.startswith(message.format(tmp=tmp_path)), line


def test_an_unexpected_error_is_one_line_naming_its_type(capsys):
    line = ends(lambda: {}["x"], "train.py", None, capsys)
    assert line == f"train.py: KeyError: 'x' (an internal error; {TRACEBACK}=1 shows the traceback)"


def test_a_traceback_only_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv(TRACEBACK, "1")
    with pytest.raises(ValueError, match="num_attention_heads=0"):
        run_main(memory_plan.main, memory_plan.__file__, ["--model", config_json(tmp_path, num_attention_heads=0)])


# ------------------------------------------------------------------------------------------- a full disk, Ctrl-C
def _full_disk(*a, **k):
    raise SafetensorError(FULL_DISK)  # what safetensors raises: not an OSError, and no path in it


def test_a_full_disk_writing_the_servables_is_one_line_naming_the_path(servables, tmp_path, monkeypatch, capsys):
    from serving import hf_io
    monkeypatch.setattr(hf_io, "save_file", _full_disk)
    policy = servables[1]
    line = ends(lambda: export.write_servables(str(tmp_path), policy, None, require_draft=False), "train.py", None,
                capsys)
    assert re.fullmatch(rf"train.py: \[Errno 28\] No space left on device: '{tmp_path}/policy\.tmp\d+/"
                        r"model.safetensors'", line), line
    assert os.listdir(tmp_path) == []  # nothing half-written is left


def test_a_full_disk_writing_a_checkpoint_or_the_warmup_cache_names_the_path(tmp_path, monkeypatch):
    from checkpoints import checkpoint
    monkeypatch.setattr(checkpoint.torch, "save", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on "
                                                                                               "device")))
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*rank00000.pt'"):
        save_checkpoint(tmp_path / "ckpt", 1, states={}, rng=capture_rng())
    with pytest.raises(OSError, match=rf"\[Errno 28\] No space left on device: '{tmp_path}/policy-x'"):
        warmup.publish(str(tmp_path / "policy-x"), _full_disk)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("policy-x")]


def _ctrl_c(cfg, mesh, log):
    if os.path.isdir(os.path.join(cfg.out, "ckpt")):
        os.mkdir(os.path.join(cfg.out, "ckpt", ".tmp-step_000003"))  # a save that Ctrl-C cut short
    raise KeyboardInterrupt


@pytest.mark.parametrize("checkpointed", [True, False])
def test_ctrl_c_says_where_the_last_checkpoint_is_and_how_to_resume(tmp_path, monkeypatch, capsys, checkpointed):
    out = tmp_path / "run"
    argv = ["--preset=test", f"--out={out}", f"--cache_dir={tmp_path / 'cache'}", "--ckpt_every=1"]
    if checkpointed:
        cfg = parse_args(argv)
        save_checkpoint(out / "ckpt", 2, states={}, rng=capture_rng(), config=dataclasses.asdict(cfg),
                        mesh=(1, 1, 1))
        argv.append("--resume")
    monkeypatch.setattr(train, "build", _ctrl_c)
    line = ends(train.main, train.__file__, argv, capsys, code=130)
    if checkpointed:
        assert line == (f"train.py: interrupted; the last checkpoint is {out}/ckpt/step_000002: to continue, run the "
                        "same command with --resume")
        assert os.listdir(out / "ckpt") == ["step_000002"]
    else:
        assert line == f"train.py: interrupted; no checkpoint in {out}/ckpt (--ckpt_every=1): a rerun starts over"


SLOW_BUILD = """
import runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a parent that ignores SIGINT (a background job) passes it on
sys.path.insert(0, {root!r})
import harness.experiment as e
def build(cfg, mesh, log):
    print("building", flush=True)
    time.sleep(60)
e.build = build
sys.argv = ["train.py", *{argv!r}]
runpy.run_path({root!r} + "/train.py", run_name="__main__")
"""


def test_a_real_sigint_ends_in_the_same_one_line(tmp_path):
    """The signal itself, in a process of its own (~4 s: importing torch)."""
    import signal
    import subprocess
    import sys
    out = tmp_path / "run"
    argv = ["--preset=test", f"--out={out}", f"--cache_dir={tmp_path / 'cache'}", "--ckpt_every=1"]
    save_checkpoint(out / "ckpt", 1, states={}, rng=capture_rng(), config=dataclasses.asdict(parse_args(argv)),
                    mesh=(1, 1, 1))
    (tmp_path / "slow.py").write_text(SLOW_BUILD.format(root=ROOT, argv=argv + ["--resume"]))
    p = subprocess.Popen([sys.executable, str(tmp_path / "slow.py")], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "building\n"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and err == (f"train.py: interrupted; the last checkpoint is {out}/ckpt/step_000001: "
                                           "to continue, run the same command with --resume\n"), err


# --------------------------------------------------------------------------- 3. --draft exports checked as --model
def _nan(d):
    sd = load_file(str(d / "model.safetensors"))
    sd["midlayer.self_attn.o_proj.weight"][1, 2] = float("nan")
    save_file(sd, str(d / "model.safetensors"))


def _edit_config(**changes):
    def damage(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg = {k: v for k, v in {**cfg, **changes}.items() if v is not None}
        (d / "config.json").write_text(json.dumps(cfg))
    return damage


@pytest.mark.parametrize("damage, message", [
    (_nan, "model.safetensors: tensor(s) ['midlayer.self_attn.o_proj.weight'] hold NaN or inf"),  # was IndexError
    (_edit_config(hidden_size=None), "config.json: missing key(s) ['hidden_size']"),  # was KeyError
    (_edit_config(intermediate_size=128), "model.safetensors: tensor 'midlayer.mlp.gate_proj.weight' has shape "
                                          "(64, 32), expected (128, 32) from config.json (intermediate_size=128"),
    (_edit_config(num_key_value_heads=3), "config.json: num_key_value_heads=3: expected a divisor of "
                                          "num_attention_heads=4"),
    (lambda d: (d / "config.json").write_text("{"),
     "config.json: not a readable JSON file (JSONDecodeError: Expecting property name"),
])
def test_a_bad_draft_export_is_one_line_naming_the_file(servables, tmp_path, damage, message):
    d, policy = _copy(servables, tmp_path)
    damage(d / "draft")
    with pytest.raises(ValueError, match=re.escape(f"{d}/draft/{message}")) as e:
        load_draft(str(d / "draft"), policy)
    assert "\n" not in str(e.value)


def test_a_draft_copied_away_from_its_run_works_on_its_own(servables, tmp_path):
    """Was: `cp -a runs/x/draft d` refused as --draft d ("policy/servable.json is missing")."""
    shutil.copytree(servables[0] / "draft", tmp_path / "d")
    draft = load_draft(str(tmp_path / "d"), servables[1])
    assert draft.tap_layers == (1, 2, 3)


@pytest.mark.parametrize("name", ["generation_config.json", "config.json", "tokenizer_config.json"])
def test_bad_json_in_the_models_files_names_the_file(tmp_path, name):
    """Was: "Expecting property name enclosed in double quotes: line 1 column 19", no file named."""
    from hf_util import write_tokenizer
    from tasks.hf_task import HFTokenizer
    write_tokenizer(tmp_path)
    (tmp_path / name).write_text('{"eos_token_id": 2,}')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/{name}: invalid JSON (Expecting property name "
                                                   "enclosed in double quotes at line 1")):
        HFTokenizer(str(tmp_path))
    if name == "tokenizer_config.json":  # the chat template's reader too
        from tasks.hf_data import ChatTemplate
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/{name}: invalid JSON")):
            ChatTemplate.for_checkpoint(str(tmp_path))


# ------------------------------------------------------------------------------------ 4. --help and checks agree
@pytest.mark.parametrize("argv, field, value", [(["--zero1", "auto"], "zero1", "auto"),
                                                (["--frozen_arm", "true"], "frozen_arm", True),
                                                (["--resume", "false", "--steps", "3"], "resume", False)])
def test_the_key_value_form_works_for_every_flag(argv, field, value):
    """Was: "argument 'auto': expected --key=value", naming no flag."""
    assert getattr(parse_args(argv), field) == value


def test_a_bad_value_in_the_key_value_form_names_the_flag():
    with pytest.raises(ValueError, match=re.escape("--cold_arm=x: expected true, false or auto")):
        parse_args(["--cold_arm", "x"])


_SPECIAL = re.compile(r"[(;]\s*(-?\d+(?:\.\d+)?|auto)\s*(?::|=|means)\s")  # "(0: greedy)", "(0 = never)", "; 0: ..."


def _documented(text: str) -> list:
    return _SPECIAL.findall(text)


def test_every_special_value_trains_help_documents_is_accepted():
    """"0 means ..." in a flag's help (its comment or its expectation) is a value the check accepts. Was:
    --temperature's help said 0 is greedy, the check refused it (GRPO needs distinct samples: the help now says so)."""
    expect = {k: rule[1].format(**vars(Config())) for k, rule in CHECKS.items()}
    cases = [(name, v) for _, fields in field_docs(Config) for name, comment in fields
             for v in _documented(f"{comment} ; {expect[name]}")]
    assert ("max_new_tokens", "0") in cases and ("rl_seed", "-1") in cases  # the extractor finds them
    for name, v in cases:
        parse_args([f"--{name}={v}"])
    assert "0: greedy" not in help_text() and "greedy" in expect["temperature"]


def test_every_special_value_the_planning_tools_help_documents_is_accepted():
    cases = [(f, v) for f, h in cost_model.HELP.items() for v in _documented(h)]
    assert ("k", "0") in cases and ("accept_len", "0") in cases
    for f, v in cases:  # taken as given (was: 0 == False, dropped as unset: --k 0 predicted k = 4)
        assert getattr(cost_model.parse([f"--{f}", v])[2], f) == float(v), f
    for flag in ("--flops", "--bw", "--cores"):  # "0: the device's"
        cost_model.parse([flag, "0"])
    own = memory_plan.parse(["--gpus", "0", "--seq", "0"])[2]  # the memory plan's docstring: 0 is the default's rule
    assert own["gpus"] == 0 and own["seq"] == 0


ENTRY_POINTS = ["train.py", "harness/memory_plan.py", "harness/cost_model.py", "harness/cost_check.py",
                "harness/warmup.py", "harness/report.py", "serving/export.py", "serving/hf_io.py"] + sorted(
    os.path.join("bench", f) for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py"))


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_every_entry_point_ends_through_run_main(path):
    src = open(os.path.join(ROOT, path), encoding="utf-8").read()
    block = src[src.index('if __name__ == "__main__":'):]
    assert "run_main(" in block, f"{path}: its __main__ block should end in parallel.cli.run_main"
