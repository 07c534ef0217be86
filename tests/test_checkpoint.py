"""checkpoint.py: exact round trip, atomicity under damage and crashes, multi-rank saves, pruning, and a real SIGKILL.

The SIGKILL test runs this file as a script (`python tests/test_checkpoint.py FOLDER STEPS OUT PAUSE`): a tiny model
trained with SGD + momentum on data drawn from a checkpointed generator, dropout from the global torch stream, and
noise from python's and numpy's streams, saving every step. Killed and resumed, it must end with the same metrics and
weights as a run that was never interrupted.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from checkpoints import checkpoint
from checkpoints.checkpoint import capture_rng, latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint


ROOT = Path(__file__).resolve().parent.parent


def _draws(gen):
    return (torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), torch.rand(3, generator=gen).tolist())


def _trained(seed=0):
    torch.manual_seed(seed)
    model, draft = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    opt_p, opt_d = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.SGD(draft.parameters(), 0.1, 0.9)
    for _ in range(3):
        loss = draft(model(torch.randn(5, 4))).square().mean()
        opt_p.zero_grad(), opt_d.zero_grad(), loss.backward(), opt_p.step(), opt_d.step()
    return model, draft, opt_p, opt_d


def _states(model, draft, opt_p, opt_d):
    return {"policy": model.state_dict(), "draft": draft.state_dict(),
            "policy_opt": opt_p.state_dict(), "draft_opt": opt_d.state_dict()}


def _save(folder, step, **kw):
    return save_checkpoint(folder, step, states={"w": {"x": torch.full((4,), float(step))}}, rng=capture_rng(),
                           metrics=[{"step": s} for s in range(step)], **kw)


def _steps(folder):
    return sorted(int(m.group(1)) for p in Path(folder).iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name)))


def test_round_trip_is_exact_and_rng_streams_continue(tmp_path):
    model, draft, opt_p, opt_d = _trained()
    gen = torch.Generator().manual_seed(7)
    _draws(gen)  # move every stream off its seed first
    path = save_checkpoint(tmp_path, 3, states=_states(model, draft, opt_p, opt_d), rng=capture_rng({"data": gen}),
                           metrics=[{"loss": 1.5}, {"loss": 1.25}], extra={"lr": 0.1, "name": "toy"})
    expected = _draws(gen)
    c = load_checkpoint(path)
    assert (c["step"], c["world"], c["metrics"], c["extra"]) == (3, 1, [{"loss": 1.5}, {"loss": 1.25}],
                                                                 {"lr": 0.1, "name": "toy"})
    m2, d2, p2, q2 = _trained(seed=1)  # different weights and optimizer moments, then overwritten from the checkpoint
    for obj, key in ((m2, "policy"), (d2, "draft"), (p2, "policy_opt"), (q2, "draft_opt")):
        obj.load_state_dict(c["states"][key])
    gen2 = torch.Generator().manual_seed(123)
    restore_rng(c["rng"], {"data": gen2})
    assert _draws(gen2) == expected
    x = torch.randn(5, 4)
    for m, d, op, od in ((model, draft, opt_p, opt_d), (m2, d2, p2, q2)):  # one more step must agree bit for bit
        loss = d(m(x)).square().mean()
        op.zero_grad(), od.zero_grad(), loss.backward(), op.step(), od.step()
    for a, b in zip([*model.parameters(), *draft.parameters()], [*m2.parameters(), *d2.parameters()]):
        assert torch.equal(a, b)


def test_restore_rng_is_loud_on_mismatch():
    state = capture_rng({"data": torch.Generator()})
    with pytest.raises(ValueError, match=r"generator names differ: saved \['data'\], given \['other'\]"):
        restore_rng(state, {"other": torch.Generator()})
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA RNG states but CUDA is not available"):
            restore_rng({**state, "cuda": [torch.zeros(8, dtype=torch.uint8)]}, {"data": torch.Generator()})


def _no_manifest(p): (p / "MANIFEST.json").unlink()
def _bad_manifest(p): (p / "MANIFEST.json").write_text('{"files": ')
def _truncated(p): (p / "rank00000.pt").write_bytes((p / "rank00000.pt").read_bytes()[:-10])
def _missing(p): (p / "meta.pt").unlink()


def _flipped(p):
    data = bytearray((p / "rank00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / "rank00000.pt").write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason, load_error", [
    (_no_manifest, "no MANIFEST.json", "is not a checkpoint .no MANIFEST.json"),
    (_bad_manifest, "unreadable MANIFEST.json .JSONDecodeError", "unreadable MANIFEST.json"),
    (_truncated, "rank00000.pt has .* bytes, the manifest says", "rank00000.pt does not match its sha256"),
    (_flipped, "rank00000.pt does not match its sha256", "rank00000.pt does not match its sha256"),
    (_missing, "meta.pt is missing", "meta.pt is missing")])
def test_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, damage, reason, load_error):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == bad
    damage(bad)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {re.escape(str(bad))}: {reason}"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    with pytest.raises((ValueError, FileNotFoundError), match=load_error):  # asked for by path: an error, not a skip
        load_checkpoint(bad)


def _crash_in_rank_file(monkeypatch):
    def half_then_die(obj, f):
        f.write(b"half a file")
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(checkpoint.torch, "save", half_then_die)


def _crash_before_commit(monkeypatch):
    def die(path):
        raise KeyboardInterrupt("killed before the rename")
    monkeypatch.setattr(checkpoint, "_fsync_dir", die)


@pytest.mark.parametrize("crash", [_crash_in_rank_file, _crash_before_commit])
def test_crash_mid_save_leaves_previous_checkpoint_then_resave_works(tmp_path, monkeypatch, crash):
    _save(tmp_path, 1)
    with monkeypatch.context() as m:
        crash(m)
        with pytest.raises(KeyboardInterrupt):
            _save(tmp_path, 2)
    assert (tmp_path / ".tmp-step_000002").is_dir() and not (tmp_path / "step_000002").exists()
    with pytest.warns(UserWarning, match=r"ignoring .*\.tmp-step_000002: temporary directory left by an interrupted"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    path = _save(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == ["step_000001", "step_000002"]  # the leftover is cleaned up
    assert latest_checkpoint(tmp_path) == path and load_checkpoint(path)["step"] == 2


def test_multi_rank_save_writes_one_file_per_rank_and_one_manifest(tmp_path, monkeypatch):
    """... and each rank hashes only its own file (rank 0 its own and the metadata: no rank reads another's back)."""
    world, barrier, errors = 3, threading.Barrier(3, timeout=20), []
    shards = [{"layers.0.w": torch.randn(2, 2)}, {"layers.1.w": torch.randn(2, 2)}, {}]  # rank 2: a replica
    hashed, sha = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256",
                        lambda p: hashed.append((threading.current_thread().name, p.name)) or sha(p))

    def rank_main(r, step):
        threading.current_thread().name = f"rank {r}"
        try:
            save_checkpoint(tmp_path, step, states={"policy": shards[r]}, rng=capture_rng(), metrics=[{"r": r}],
                            extra={"from": r}, rank=r, world=world, barrier=barrier.wait)
        except BaseException as e:  # noqa: BLE001 -- reported to the test thread below
            errors.append(e)
            barrier.abort()

    for step in (1, 2):
        threads = [threading.Thread(target=rank_main, args=(r, step)) for r in range(world)]
        [t.start() for t in threads], [t.join(timeout=30) for t in threads]
        assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(set(hashed)) == [("rank 0", "meta.pt"), ("rank 0", "rank00000.pt"), ("rank 1", "rank00001.pt"),
                                   ("rank 2", "rank00002.pt")]
    path = tmp_path / "step_000002"
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "meta.pt", "rank00000.pt", "rank00001.pt", "rank00002.pt"]
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert manifest["world"] == 3 and set(manifest["files"]) == set(os.listdir(path)) - {"MANIFEST.json"}
    for r in range(world):
        c = load_checkpoint(path, rank=r)
        assert c["metrics"] == [{"r": 0}] and c["extra"] == {"from": 0}  # shared metadata comes from rank 0
        assert c["states"]["policy"].keys() == shards[r].keys()
        assert all(torch.equal(v, shards[r][k]) for k, v in c["states"]["policy"].items())
    with pytest.raises(ValueError, match="saved by 3 rank.*no file for rank 3"):
        load_checkpoint(path, rank=3)
    (path / "rank00001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="rank00001.pt is missing"):
        load_checkpoint(path, rank=1)
    with pytest.warns(UserWarning, match="step_000002: rank00001.pt is missing"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"


def test_pruning_keeps_the_newest_and_never_the_new_one(tmp_path):
    for s in range(1, 6):
        _save(tmp_path, s, keep_last=2)
    assert _steps(tmp_path) == [4, 5]
    with pytest.warns(UserWarning, match="deleting the checkpoints of steps 4, 5 > 3 in "):
        _save(tmp_path, 3, keep_last=None)  # keep all: still only steps up to the new one are kept
    assert _steps(tmp_path) == [3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_save_deletes_checkpoints_of_later_steps_so_resume_never_picks_them(tmp_path):
    """The issue's scenario: an older run left steps 5-7; a new run in the same folder saves step 4 and is killed.
    Its resume must continue from its own step 4, not the older run's step 7 -- whatever keep_last says."""
    for s in (5, 6, 7):
        _save(tmp_path, s, keep_last=None)
    (tmp_path / ".tmp-step_000008").mkdir()  # and an interrupted save of the older run
    for keep in (None, 1):
        with pytest.warns(UserWarning, match=r"deleting the checkpoints of steps 5, 6, 7 > 4 in .*: another history"):
            new = save_checkpoint(tmp_path, 4, states={"w": {"x": torch.zeros(1)}}, rng=capture_rng(), keep_last=keep)
        assert _steps(tmp_path) == [4] and latest_checkpoint(tmp_path) == new
        assert torch.equal(load_checkpoint(new)["states"]["w"]["x"], torch.zeros(1))
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
        for s in (5, 6, 7):  # again, for the other keep_last
            _save(tmp_path, s, keep_last=None)


def test_bad_input_gives_clear_errors(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing_here") is None
    with pytest.raises(FileNotFoundError, match="is not a checkpoint .no such directory"):
        load_checkpoint(tmp_path / "nothing_here")
    with pytest.raises(FileNotFoundError, match="is not a checkpoint .no MANIFEST.json; find one with latest"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="needs a barrier"):
        _save(tmp_path, 1, rank=0, world=2)
    with pytest.raises(ValueError, match=r"rank=2 is not in range\(world=2\)"):
        _save(tmp_path, 1, rank=2, world=2, barrier=lambda: None)
    with pytest.raises(ValueError, match="keep_last=0"):
        _save(tmp_path, 1, keep_last=0)
    path = _save(tmp_path, 1)
    with pytest.raises(ValueError, match="saved by 1 rank.*no file for rank 1"):
        load_checkpoint(path, rank=1)


def test_manifest_records_mesh_config_and_code_version_and_files_load_safely(tmp_path, monkeypatch):
    cfg = {"lr": 3e-4, "name": "toy", "std_norm": True}
    path = save_checkpoint(tmp_path, 2, states={"w": {"x": torch.ones(2)}}, rng=capture_rng(), config=cfg,
                           mesh=(1, 1, 1), metrics=[{"loss": np.float64(0.5), "n": np.int64(3)}])
    m = checkpoint.read_manifest(path)
    assert m["mesh"] == {"pp": 1, "cp": 1, "dp": 1} and m["config"] == cfg
    assert set(m["code"]) == {"version", "commit", "dirty"}
    loads = []
    real = torch.load
    monkeypatch.setattr(checkpoint.torch, "load", lambda *a, **k: loads.append(k["weights_only"]) or real(*a, **k))
    c = load_checkpoint(path)
    assert loads == [True, True] and c["config"] == cfg and c["mesh"] == m["mesh"]
    assert c["metrics"] == [{"loss": 0.5, "n": 3}] and type(c["metrics"][0]["loss"]) is float  # numpy -> Python
    with pytest.raises(ValueError, match=r"mesh=\(2, 1, 1\): expected \(pp, cp, dp\).*world = 1"):
        save_checkpoint(tmp_path, 3, states={}, rng=capture_rng(), mesh=(2, 1, 1))


def test_save_refuses_what_the_safe_loader_would_refuse_naming_where(tmp_path):
    with pytest.raises(TypeError, match=r"states/rng\['states'\]\['opt'\]\['m'\]: a numpy.ndarray cannot go into"):
        save_checkpoint(tmp_path, 1, states={"opt": {"m": np.zeros(3)}}, rng=capture_rng())
    assert not (tmp_path / "step_000001").exists()


def test_code_version_without_git_gives_none(monkeypatch):
    def no_git(*a, **k):
        raise FileNotFoundError("git")
    checkpoint.code_version.cache_clear()
    monkeypatch.setattr(checkpoint.subprocess, "run", no_git)
    try:
        v = checkpoint.code_version()
        assert v["commit"] is None and v["dirty"] is None
    finally:
        checkpoint.code_version.cache_clear()


# ---- a real SIGKILL: the loop below runs as a child process ----

STEPS = 20

def _toy_run(folder, steps, out, pause):
    torch.set_num_threads(1)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    data = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    # SGD with momentum written out: its buffers are optimizer state that must survive the kill (torch.optim would do,
    # but its first use imports torch._dynamo, seconds per child process)
    momentum = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    start, metrics = 0, []
    if (path := latest_checkpoint(folder)) is not None:
        c = load_checkpoint(path)
        model.load_state_dict(c["states"]["model"]), momentum.update(c["states"]["opt"])
        restore_rng(c["rng"], {"data": data})
        start, metrics = c["step"], c["metrics"]
    print(f"start {start}", flush=True)
    for step in range(start, steps):
        x = torch.randn(16, 4, generator=data)
        y = x.sum(1, keepdim=True) + 0.1 * float(np.random.randn()) + 0.1 * random.random()
        loss = F.mse_loss(model(x), y)  # dropout draws from the global torch stream
        model.zero_grad(), loss.backward()
        with torch.no_grad():
            for k, w in model.named_parameters():
                momentum[k].mul_(0.9).add_(w.grad)
                w.sub_(0.05 * momentum[k])
        metrics.append({"step": step, "loss": loss.item()})
        save_checkpoint(folder, step + 1, states={"model": model.state_dict(), "opt": momentum},
                        rng=capture_rng({"data": data}), metrics=metrics, extra={"steps": steps}, keep_last=2)
        time.sleep(pause)
    Path(out).write_text(json.dumps({"metrics": metrics, "weights": [p.tolist() for p in model.parameters()]}))


def _child(tmp_path, tag, folder, steps=STEPS, pause=0.05):
    out = tmp_path / f"{tag}.json"
    with open(tmp_path / f"{tag}.log", "w") as log:  # the child keeps its own copy of the descriptor
        p = subprocess.Popen([sys.executable, __file__, str(folder), str(steps), str(out), str(pause)],
                             stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p, out, tmp_path / f"{tag}.log"


def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path):
    ref, ref_out, ref_log = _child(tmp_path, "reference", tmp_path / "ref_ckpt")
    run, _, _ = _child(tmp_path, "killed", tmp_path / "ckpt")
    children = [ref, run]
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ckpt").is_dir() or max(_steps(tmp_path / "ckpt"), default=0) < 5:
            assert run.poll() is None and time.monotonic() < deadline, "the child died or stalled before step 5"
            time.sleep(0.005)
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=10) == -signal.SIGKILL
        assert 5 <= max(_steps(tmp_path / "ckpt")) < STEPS  # it really stopped mid-way
        resumed, out, log = _child(tmp_path, "resumed", tmp_path / "ckpt")
        children.append(resumed)
        assert resumed.wait(timeout=60) == 0, log.read_text()
        assert ref.wait(timeout=60) == 0, ref_log.read_text()
    finally:
        for p in children:  # every child is gone when the test ends, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    start = int(re.search(r"start (\d+)", log.read_text()).group(1))
    assert 5 <= start < STEPS
    got, want = json.loads(out.read_text()), json.loads(ref_out.read_text())
    assert [m["step"] for m in got["metrics"]] == list(range(STEPS))  # nothing lost, nothing repeated
    assert got == want  # exact: same losses at every step and the same final weights


if __name__ == "__main__":
    _toy_run(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
