"""The careful user's battery: bad flags, tampered or foreign checkpoints, broken HF files and wrong API
inputs each end in one clear error that names the flag, file, key or argument -- never a silent wrong answer, a run
that starts over, or code run from a checkpoint.

Fast: the CLI cases run config.parse_args only (no training); the checkpoint cases write tiny checkpoints; one case
spawns 2 gloo processes (run_distributed fails after its timeout instead of hanging).
"""
import dataclasses
import io
import json
import os
import re
import threading
import warnings

import pytest
import torch

from checkpoints import checkpoint
from harness import config
from checkpoints.checkpoint import capture_rng, latest_checkpoint, load_checkpoint, save_checkpoint
from harness.config import CHECKS, PRESETS, Config, parse_args
from parallel.consistency import check_finite, check_same_cu_seqlens, fingerprint
from dist_util import run_distributed
from checkpoints.resume_policy import (RESUME_MAY_CHANGE, NoCheckpointError, check_fresh_out_dir, check_resumable,
                           checkpoint_to_resume, prepare_fresh_out_dir)

# ---------------------------------------------------------------------------------------------- every flag checked
# The issue's cases, with the exact message.
ISSUE_FLAGS = [
    ("--grad_clip=-1", "--grad_clip=-1: expected > 0"),  # a negative clip bound flips the gradient: ascent
    ("--beta=-0.1", "--beta=-0.1: expected >= 0"),
    ("--p_explicit=1.5", "--p_explicit=1.5: expected in [0, 1]"),
    ("--draft_lam=-1", "--draft_lam=-1: expected >= 0"),
    ("--eval_prompts=0", "--eval_prompts=0: expected >= 1"),  # was a ZeroDivisionError
    ("--eval_samples=0", "--eval_samples=0: expected >= 1"),  # was a ZeroDivisionError
    ("--sft_batch=0", "--sft_batch=0: expected >= 1"),  # was "pack: expected a non-empty list"
    ("--lr=-0.01", "--lr=-0.01: expected >= 0"),  # failed inside torch's Adam (0: the no-drift control)
    ("--lr=inf", "--lr=inf: expected a finite number"),
    ("--temperature=nan", "--temperature=nan: expected a finite number"),
]

# One value out of range for every field that has a range or a choice (bools: the type is the check, below).
BAD_VALUE = {
    "name": "a/b", "seed": "-1", "threads": "0", "warmup_threads": "0", "device": "gpu", "out": "{file}",
    "cache_dir": "", "min_steps": "0", "max_steps": "19", "p_explicit": "-0.1", "format_weight": "-1", "model": "giant",
    "draft": "no/such/draft",
    "data": "nope.jsonl", "eval_fraction": "1", "max_prompt_tokens": "0", "max_new_tokens": "-1", "sft_steps": "0",
    "sft_batch": "0", "sft_lr": "0", "draft_warmup_steps": "-1", "draft_warmup_batch": "2000", "draft_warmup_lr": "0",
    "draft_warmup_pool": "0", "draft_lr": "-0.001", "draft_lam": "-0.5", "draft_grad_clip": "0", "ttt_passes": "0",
    "steps": "0", "prompts_per_step": "0", "group_size": "1", "temperature": "0", "num_draft_tokens": "0",
    "rollout_batch": "0", "lr": "-0.01", "grad_clip": "0", "updates": "257", "micro_batches": "0", "eps_low": "1",
    "eps_high": "-0.1", "beta": "-1", "loss_norm": "mean", "eval_every": "0", "eval_prompts": "0", "eval_samples": "0",
    "pp": "0", "cp": "0", "dp": "-1", "schedule": "gpipe", "ckpt_every": "-1", "dist_timeout": "0",
    "prompt_key": "", "answer_key": "", "chat_template": "nope.jinja", "reward": "my_rewards:f", "draft_vocab": "-1",
    "log": "csv",
    "tree": "2,0,1",
    "attn_backend": "cuda", "chunk_mib": "-1",
    "rl_seed": "-2", "eval_draft_tokens": "-1", "bootstrap": "0", "task": "nope",
    "ttt_decay": "1.5", "tap_layers": "0,1", "dtype": "fp16", "max_draft_tokens": "0",
    "frozen_arm": "maybe", "cold_arm": "yes", "offline_arm": "on", "log_kl": "2", "draft_every": "0",
    "zero1": "maybe", "device_gib": "-1", "micro_batch_tokens": "-5",
    "rollout_engine": "sglang",
    "drafter": "medusa", "block_size": "1", "anchors": "0", "block_gamma": "-1", "draft_layers": "0",
    "mask_token_id": "-2", "markov_rank": "0", "confidence_threshold": "1.5",
}
FIELDS = {f.name: f.type for f in dataclasses.fields(Config)}


def test_every_config_field_has_a_stated_check_and_a_bad_value_here():
    assert set(CHECKS) == set(FIELDS), "add a row to config.CHECKS for every new Config field"
    missing = {k for k, t in FIELDS.items() if t != "bool"} - set(BAD_VALUE)  # bools: the type is the check
    assert not missing, f"add an out-of-range value to BAD_VALUE for {sorted(missing)}"


@pytest.mark.parametrize("flag, message", ISSUE_FLAGS)
def test_the_issues_flags_are_refused_with_the_expected_range(flag, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args([flag])


@pytest.mark.parametrize("key", sorted(BAD_VALUE))
def test_every_field_refuses_a_value_out_of_its_range(key, tmp_path):
    (tmp_path / "f").write_text("")
    value = BAD_VALUE[key].format(file=tmp_path / "f")
    shown = value if value else "''"
    with pytest.raises(ValueError, match=re.escape(f"--{key}={shown}: expected ")):
        parse_args([f"--{key}={value}"])


@pytest.mark.parametrize("kw, message", [
    ({"resume": "yes"}, "--resume=yes: expected true or false"),
    ({"steps": 2.5}, "--steps=2.5: expected an integer"),
    ({"lr": "fast"}, "--lr=fast: expected a finite number"),
    ({"name": 3}, "--name=3: expected a string"),
    ({"resume": True, "overwrite": True}, "--overwrite=true: expected false with --resume"),
    ({"no_spec": True, "cold_arm": True}, "--no_spec=true: expected false with --draft, --cold_start"),
    ({"no_spec": True, "num_draft_tokens": "auto"}, "--no_spec=true: expected false with"),
])
def test_types_and_contradictions_are_refused(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config(**kw)


def test_all_bad_fields_are_reported_at_once_and_every_preset_is_valid():
    with pytest.raises(ValueError, match=r"--beta=-1: expected >= 0; --lr=-1: expected >= 0"):
        parse_args(["--beta=-1", "--lr=-1"])
    for name in PRESETS:
        parse_args([f"--preset={name}"])


# --------------------------------------------------------------------------------------------- safe checkpoints
class Payload:
    """Unpickling this calls open(path, "w"): a file appears if, and only if, the payload runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _save(folder, step, **kw):
    return save_checkpoint(folder, step, states={"w": {"x": torch.ones(2)}}, rng=capture_rng(),
                           metrics=[{"step": s} for s in range(step)], **kw)


def _rehash(path):
    m = json.loads((path / "MANIFEST.json").read_text())
    for name, entry in m["files"].items():
        entry.update(bytes=(path / name).stat().st_size, sha256=checkpoint._sha256(path / name))
    (path / "MANIFEST.json").write_text(json.dumps(checkpoint.seal(m)))  # and reseals the manifest


def test_a_pickle_payload_with_a_rehashed_manifest_is_refused_without_running(tmp_path):
    marker = tmp_path / "payload_ran"
    buf = io.BytesIO()
    torch.save({"states": {}, "rng": Payload(marker)}, buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False)["rng"].close()  # control: the unsafe loader runs it
    assert marker.exists()
    marker.unlink()
    path = _save(tmp_path / "ckpt", 1)
    (path / "rank00000.pt").write_bytes(buf.getvalue())
    _rehash(path)  # the attacker recomputes the sha256: the manifest check alone passes
    assert latest_checkpoint(tmp_path / "ckpt") == path
    with pytest.raises(ValueError, match=r"rank00000.pt: refused by the safe loader .*Unsupported global.*open"):
        load_checkpoint(path)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- honest resumes
def test_a_fresh_run_refuses_a_directory_holding_checkpoints(tmp_path):
    _save(tmp_path / "ckpt", 3)
    with pytest.raises(FileExistsError, match=r"ckpt holds checkpoints of an earlier run \(steps 3\): add --resume "
                                              r"to continue it, --overwrite to delete them .*or choose a new --out"):
        check_fresh_out_dir(tmp_path)
    with pytest.raises(FileExistsError):
        prepare_fresh_out_dir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"old": 1}\n')
    notes = prepare_fresh_out_dir(tmp_path, overwrite=True)
    assert notes == [f"--overwrite: deleted the earlier checkpoints in {tmp_path / 'ckpt'}"]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # overwrite: the new run replaces the results


def test_a_fresh_run_into_a_directory_without_checkpoints_keeps_the_earlier_results(tmp_path):
    check_fresh_out_dir(tmp_path / "new")  # nothing there: allowed
    (tmp_path / "ckpt").mkdir()  # an empty ckpt/ holds no checkpoint
    for name in ("metrics.jsonl", "summary.json"):
        (tmp_path / name).write_text("first run")
    for n in (1, 2):  # the README's second (and third) run
        assert prepare_fresh_out_dir(tmp_path) == [f"kept the earlier results: metrics.jsonl, summary.json moved to "
                                                   f"{tmp_path / f'earlier-{n}'}"]
        assert (tmp_path / f"earlier-{n}" / "metrics.jsonl").read_text() == "first run"
        assert not (tmp_path / "metrics.jsonl").exists()
        for name in ("metrics.jsonl", "summary.json"):
            (tmp_path / name).write_text("first run")


@pytest.mark.parametrize("state, why", [("missing", "no such directory"), ("empty", "it holds no checkpoint"),
                                        ("damaged", "its 1 checkpoint.s. are damaged or incomplete")])
def test_resume_without_a_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path, state, why):
    folder = tmp_path / "ckpt"
    if state != "missing":
        folder.mkdir()
    if state == "damaged":
        (_save(folder, 2) / "MANIFEST.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the damaged one is skipped with a warning
        with pytest.raises(NoCheckpointError, match=rf"--resume: no valid checkpoint in .*ckpt \({why}"):
            checkpoint_to_resume(folder)


CFG = dataclasses.asdict(parse_args(["--preset=test"]))


@pytest.mark.parametrize("change, mesh, message", [
    ({"lr": 1e-4}, (1, 1, 1), r"another config; lr: checkpoint 0.0005, now 0.0001\. A resume may change only "),
    ({"lr": 1e-4, "seed": 5}, (1, 1, 1), r"lr: checkpoint 0.0005, now 0.0001; seed: checkpoint 0, now 5"),
    ({}, (2, 1, 2), r"written on the mesh pp=2 x cp=2 x dp=1, this run's is pp=2 x cp=1 x dp=2: .*\(resume with "
                    r"--pp=2 --cp=2 --dp=1 on 4 rank"),
    ({"steps": 1}, (1, 1, 1), r"has done 2 steps: --steps=1 is fewer"),
])
def test_resume_refuses_another_config_or_mesh_naming_them(tmp_path, change, mesh, message):
    saved_mesh = (2, 2, 1) if mesh != (1, 1, 1) else (1, 1, 1)
    path = _save_world(tmp_path, 2, saved_mesh)
    with pytest.raises(ValueError, match=message):
        check_resumable(path, {**CFG, **change}, mesh)


def _save_world(folder, step, mesh):
    """A checkpoint written by pp * cp * dp ranks (threads, as in tests/test_checkpoint.py)."""
    world = mesh[0] * mesh[1] * mesh[2]
    barrier, errors = threading.Barrier(world, timeout=20), []

    def rank_main(r):
        try:
            _save(folder, step, config=CFG, mesh=mesh, rank=r, world=world, barrier=barrier.wait)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    [t.start() for t in threads], [t.join(timeout=30) for t in threads]
    assert not errors and not any(t.is_alive() for t in threads)
    return folder / f"step_{step:06d}"


def test_resume_allows_run_length_and_housekeeping_to_change(tmp_path):
    path = _save(tmp_path, 2, config=CFG, mesh=(1, 1, 1))
    allowed = {"steps": 50, "threads": 2, "warmup_threads": 1, "dist_timeout": 60, "eval_every": 5, "ckpt_every": 2,
               "device": "cpu", "out": "elsewhere", "cache_dir": "c2", "resume": True, "pp": 4, "dp": 3}
    assert set(allowed) - {"pp", "dp"} <= RESUME_MAY_CHANGE
    check_resumable(path, {**CFG, **allowed}, (1, 1, 1))  # pp/dp fields only matter as the resolved mesh
    m = json.loads((path / "MANIFEST.json").read_text())
    m["code"] = {"version": "0.0.1", "commit": "abc", "dirty": False}
    (path / "MANIFEST.json").write_text(json.dumps(checkpoint.seal(m)))
    with pytest.warns(UserWarning, match=r"written by cospec 0.0.1 at commit abc, this is .*resuming with the new"):
        check_resumable(path, CFG, (1, 1, 1))


# ------------------------------------------------------------------------------------- errors that name the thing
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from serving.hf_io import save_pretrained
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf")
    save_pretrained(Transformer(ModelConfig.preset("tiny")), str(d))
    return d


def _truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def _bad_json(d):
    (d / "config.json").write_text('{"vocab_size": 97,')


def _missing_key(d):
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage, message", [
    (_truncate, r"model.safetensors: unreadable safetensors file \(.*\); truncated"),
    (_bad_json, r"config.json: invalid JSON \(.* at line 1, column \d+\)"),
    (_missing_key, r"config.json: missing key 'num_attention_heads'"),
])
def test_hf_checkpoint_errors_name_the_file_and_key(hf_dir, tmp_path, damage, message):
    from serving.hf_io import from_pretrained
    d = tmp_path / "copy"
    d.mkdir()
    for name in os.listdir(hf_dir):
        (d / name).write_bytes((hf_dir / name).read_bytes())
    damage(d)
    with pytest.raises(ValueError, match=re.escape(str(d)) + "/" + message):
        from_pretrained(str(d))


@pytest.mark.parametrize("eos_id", [97, -1, 2.0, True])
def test_generate_refuses_an_eos_id_outside_the_vocabulary(eos_id):
    from model import ModelConfig, Transformer
    from speculative import generate
    m = Transformer(ModelConfig.preset("tiny"))  # vocab 97
    with pytest.raises(ValueError, match=re.escape(f"eos_id={eos_id!r}: expected an int token id in [0, "
                                                   "vocab_size=97)")):
        generate(m, None, [torch.tensor([1, 2, 3])], max_new_tokens=2, eos_id=eos_id)
    with pytest.raises(ValueError, match=r"prompts\[1\]: token ids must lie in \[0, vocab_size=97\), got min 0 max 97"):
        generate(m, None, [torch.tensor([1]), torch.tensor([0, 97])], max_new_tokens=2)


@pytest.mark.parametrize("taps", [(1.7,), (0, 1.0), (True,), ("1",)])
def test_tap_ids_must_be_integers_not_truncated(taps):
    from model import check_tap_layers
    with pytest.raises(ValueError, match=r"is not an integer layer id"):
        check_tap_layers(taps, 4)


def test_check_finite_names_the_tensor_and_row():
    q, k = torch.randn(6, 2, 4), torch.randn(6, 1, 4)
    check_finite(q=q, k=k, branch_k=None)
    k[4, 0, 1] = float("inf")
    with pytest.raises(FloatingPointError, match=r"attention input k \(6, 1, 4\): 1 non-finite value.s. \(inf\), "
                                                 r"first in row 4"):
        check_finite(q=q, k=k)


def _cu_worker(rank, world, cus):
    import torch.distributed as dist
    check_same_cu_seqlens([cus[0]], dist.group.WORLD)  # the same on both ranks: passes
    try:
        check_same_cu_seqlens([cus[rank]], dist.group.WORLD)  # rank 1 has other boundaries
    except ValueError as e:
        return str(e)
    return None


def test_cu_seqlens_that_differ_across_cp_ranks_fail_on_every_rank():
    a, b = torch.tensor([0, 8, 12], dtype=torch.int32), torch.tensor([0, 4, 12], dtype=torch.int32)
    assert int(fingerprint([a])) == int(fingerprint([a.long()])) != int(fingerprint([b]))
    assert int(fingerprint([a, b])) != int(fingerprint([b, a]))  # order of the micro-batches matters
    errors = run_distributed(_cu_worker, 2, args=([a, b],), timeout=60)
    for e in errors:
        assert e is not None and "cu_seqlens differ across the CP group: group rank(s) [1] disagree" in e


# --------------------------------------------------------------------------- the loop's one call: start_run
def test_start_run_gives_every_rank_the_same_checkpoint_or_the_same_error(tmp_path):
    from checkpoints.resume_policy import start_run
    fresh = {**CFG, "resume": False}
    assert start_run(tmp_path, fresh, (1, 1, 1)) == (None, [])  # an empty directory: a fresh run may start
    _save(tmp_path / "ckpt", 2, config=CFG, mesh=(1, 1, 1))
    verdicts = []
    share = lambda v: verdicts.append(v) or v  # noqa: E731 -- one process: rank 0's verdict is everyone's
    with pytest.raises(FileExistsError, match="holds checkpoints of an earlier run"):
        start_run(tmp_path, fresh, (1, 1, 1), share=share)
    with pytest.raises(FileExistsError, match="holds checkpoints of an earlier run"):  # rank 1 gets rank 0's error
        start_run(tmp_path, fresh, (1, 1, 1), rank=1, share=lambda v: verdicts[-1])
    path, notes = start_run(tmp_path, {**CFG, "resume": True}, (1, 1, 1))
    assert path == tmp_path / "ckpt" / "step_000002" and notes == [f"resume: from {path}"]
    with pytest.raises(ValueError, match="lr: checkpoint 0.0005, now 0.1"):
        start_run(tmp_path, {**CFG, "resume": True, "lr": 0.1}, (1, 1, 1))
    assert start_run(tmp_path, {**fresh, "overwrite": True}, (1, 1, 1))[0] is None
    with pytest.raises(NoCheckpointError, match="--resume: no valid checkpoint"):  # --overwrite deleted them
        start_run(tmp_path, {**CFG, "resume": True}, (1, 1, 1))


def test_a_checkpoint_of_the_old_unsafe_format_is_skipped_by_name_and_resume_stops(tmp_path):
    path = _save(tmp_path / "ckpt", 3, config=CFG, mesh=(1, 1, 1))
    m = json.loads((path / "MANIFEST.json").read_text())
    (path / "MANIFEST.json").write_text(json.dumps({**m, "format": "cospec-checkpoint/1"}))
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_000003: unreadable MANIFEST.json .*format "
                                         r"'cospec-checkpoint/1', expected 'cospec-checkpoint/2'"):
        with pytest.raises(NoCheckpointError, match="its 1 checkpoint.s. are damaged or incomplete"):
            checkpoint_to_resume(tmp_path / "ckpt")
