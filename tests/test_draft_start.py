"""--draft PATH: a run starts from a draft in the EAGLE-3 export format (harness/draft_formats.load_draft) with no
warm-up; a draft that does not fit the policy is a one-line error naming it. ~50 s on 2 shared cores under load (two
1-step `--preset test` runs: the first exports <out>/draft, the second starts from it)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from draft import Eagle3Draft
from harness.draft_formats import load_draft
from harness.config import parse_args
from harness.experiment import build
from harness.mesh import make_mesh
from model import ModelConfig, Transformer
from train import train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_from_export_round_trip_and_misfits(tmp_path):
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    d = Eagle3Draft.from_target(policy, draft_vocab=torch.arange(0, 97, 3))
    d.export(str(tmp_path / "d"))
    e = load_draft(str(tmp_path / "d"), policy)
    assert e.tap_layers == d.tap_layers and e.cfg.draft_vocab_size == 33 and e.embed_weight is not None
    for (k, a), b in zip(d.state_dict().items(), e.state_dict().values()):  # the served (bf16) values, cast up
        assert torch.equal(a.to(torch.bfloat16).to(a.dtype) if a.is_floating_point() else a, b), k
    for overrides, match in [(dict(hidden_size=64), "hidden_size=32, expected the policy's hidden_size 64"),
                             (dict(vocab_size=50), "vocab_size=97, expected the policy's vocab_size 50"),
                             (dict(num_hidden_layers=3), "taps do not fit the 3-layer policy")]:
        other = Transformer(ModelConfig.preset("tiny", **overrides))
        with pytest.raises(ValueError, match=f"draft '.*d': .*{match}"):
            load_draft(str(tmp_path / "d"), other)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="d/model.safetensors: unreadable safetensors file"):
        load_draft(str(tmp_path / "d"), policy)


@pytest.mark.parametrize("argv", [["--cold_start"], ["--draft_vocab=8"], ["--tap_layers=0,1,2"]])
def test_draft_flag_is_checked(tmp_path, argv):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--draft=.*expected '' or a draft directory"):
        parse_args(["--preset=test", f"--draft={tmp_path}"] + argv)
    with pytest.raises(ValueError, match="--draft=.*expected"):
        parse_args(["--preset=test", f"--draft={tmp_path / 'missing'}"])


def test_a_run_starts_from_an_exported_draft_without_warmup(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(parse_args(["--preset=test", "--steps=1", f"--cache_dir={tmp_path / 'cache_a'}", f"--out={a}"]))
    served = str(a / "draft")
    argv = ["--preset=test", "--steps=1", f"--cache_dir={tmp_path / 'cache_b'}", f"--draft={served}"]
    cfg = parse_args(argv + [f"--out={b}"])
    s = build(cfg, make_mesh(cfg), log=lambda *x, **k: None)
    sd = load_file(os.path.join(served, "model.safetensors"))
    for name, d in (("cotrained", s.drafts["cotrained"].draft), ("frozen", s.frozen), ("offline", s.offline.draft)):
        got = d.state_dict()
        assert all(torch.equal(got[k], v.to(got[k].dtype)) for k, v in sd.items()), name  # every arm starts there
    summary = train(cfg)
    assert summary["warmup_cached"]["draft"] is None and summary["steps"] == 1
    assert not [f for f in os.listdir(tmp_path / "cache_b") if f.startswith("draft-")]  # no draft warm-up ran
    ev0 = json.loads((b / "metrics.jsonl").read_text().splitlines()[0])
    assert ev0["kind"] == "eval" and ev0["accept_cotrained"] == ev0["accept_frozen"]  # the same draft at step 0
