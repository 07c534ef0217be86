"""logger.py: metrics.jsonl always (the record as is), TensorBoard with the same keys flattened, clear errors."""
import json
import sys

import pytest

from harness.logger import MetricsLogger, flatten, parse_backends

REC = [{"kind": "train", "step": 1, "reward": 0.25, "ok": True, "note": "x", "time": {"rollout": 1.5},
        "alpha": [0.9, 0.5], "nan": float("nan")},
       {"kind": "eval", "step": 1, "accept_cotrained": 2.5}]


def test_jsonl_is_the_record_and_flatten_names_nested_keys(tmp_path):
    lg = MetricsLogger(str(tmp_path))
    for r in REC:
        lg.log(r)
    lg.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["kind"] for l in lines] == ["train", "eval"] and json.loads(lines[0])["note"] == "x"
    assert flatten(REC[0]) == {"step": 1.0, "reward": 0.25, "ok": 1.0, "time/rollout": 1.5, "alpha/0": 0.9,
                               "alpha/1": 0.5}
    off = MetricsLogger(str(tmp_path / "rank1"), enabled=False)
    off.log(REC[0])
    off.close()
    assert not (tmp_path / "rank1").exists()


def test_backends_are_checked_and_missing_packages_named(tmp_path, monkeypatch):
    assert parse_backends("tensorboard") == ("jsonl", "tensorboard")
    assert parse_backends("jsonl, wandb,jsonl") == ("jsonl", "wandb")
    with pytest.raises(ValueError, match="tensorbord"):
        parse_backends("jsonl,tensorbord")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[wandb\]\""):
        MetricsLogger(str(tmp_path), "jsonl,wandb")


def test_tensorboard_gets_the_same_numbers(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    lg = MetricsLogger(str(tmp_path), ("jsonl", "tensorboard"))
    for r in REC:
        lg.log(r)
    lg.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert tags == {"train/reward", "train/ok", "train/time/rollout", "train/alpha/0", "train/alpha/1",
                    "eval/accept_cotrained"}
    ev = ea.Scalars("train/time/rollout")[0]
    assert ev.step == 1 and ev.value == pytest.approx(1.5)


def test_config_log_is_checked():
    from harness.config import parse_args
    assert parse_args(["--log=jsonl,tensorboard"]).log == "jsonl,tensorboard"
    with pytest.raises(ValueError, match="--log=tb: expected a comma list of jsonl, tensorboard, wandb"):
        parse_args(["--log=tb"])
