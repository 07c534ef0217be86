"""The drafter protocol and the --drafter registry: every family implements the protocol, the config builds each one
(default taps by the family's rule, the task's MASK id), refuses what a block drafter cannot do with one error naming
the flag, keys the draft warm-up by family, and a saved draft of any family reloads by its config.json. ~10 s."""
import types

import pytest
import torch

from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from drafter import PROTOCOL, check_drafter, select_rows
from harness import drafters
from harness.cache_keys import DraftSpec
from harness.config import parse_args
from harness.experiment import build_task
from harness.warmup import load_draft
from model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("mini", vocab_size=18))


@pytest.mark.parametrize("name,cls,taps", [("eagle3", Eagle3Draft, (1, 2, 3)), ("dflash", DFlashDraft, (1, 2, 3)),
                                           ("dspark", DSparkDraft, (1, 2, 3))])  # block drafts: a tap per layer (3)
def test_registry_builds_each_family(policy, name, cls, taps):
    cfg = parse_args([f"--drafter={name}", "--num_draft_tokens=3"])
    tsk = build_task(cfg)
    d = drafters.build_draft(name, policy, drafters.options(cfg, tsk))
    assert type(d) is cls and d.tap_layers == taps and all(hasattr(d, m) for m in PROTOCOL)
    if name != "eagle3":
        assert d.cfg.mask_token_id == tsk.tok.pad_id and d.cfg.num_layers == 3  # the defaults: a block of k + 1
        assert d.cfg.block_size == 4 - (name == "dspark") and d.max_draft_tokens == 3  # (dspark: k, all drafting)
    tr = drafters.config_trainer(cfg, tsk, d, None)
    assert set(d.loss_options(tr)) == ({"num_passes", "pass_weight"} if name == "eagle3" else
                                       {"anchors", "gamma", "seed"})
    assert type(d.fresh(policy)) is cls


@pytest.mark.parametrize("flags", [["--num_draft_tokens=auto"], ["--block_size=8", "--num_draft_tokens=8"],
                                   ["--block_size=8", "--num_draft_tokens=2", "--eval_draft_tokens=9"]])
def test_block_drafter_refuses_chain_features(flags):
    with pytest.raises(ValueError, match="--drafter=dflash: expected"):
        parse_args(["--drafter=dflash"] + flags)


@pytest.mark.parametrize("flags", [["--tree=2,1", "--num_draft_tokens=2"], ["--draft_vocab=8"]])
def test_block_drafter_refuses_eagle3s_flags(flags):  # tests/test_family_flags.py: every family's flags
    with pytest.raises(ValueError, match="only --drafter eagle3 reads it"):
        parse_args(["--drafter=dflash"] + flags)


def test_block_size_zero_fits_the_largest_k():
    """--block_size=0 (the default) is one slot more than the larger of num_draft_tokens and eval_draft_tokens; a
    block_size given wins and must fit them."""
    fit = parse_args(["--drafter=dflash", "--num_draft_tokens=2", "--eval_draft_tokens=5"])
    assert (fit.block_size, fit.block_slots, drafters.options(fit, build_task(fit))["block_size"]) == (0, 6, 6)
    assert parse_args(["--drafter=dspark", "--block_size=9", "--num_draft_tokens=9"]).block_slots == 9
    with pytest.raises(ValueError, match="--drafter=dflash: expected"):
        parse_args(["--drafter=dflash", "--block_size=4", "--num_draft_tokens=4"])


def test_bad_names_and_mask():
    with pytest.raises(ValueError, match="--drafter=foo"):
        parse_args(["--drafter=foo"])
    hf = types.SimpleNamespace(mask_token_id=-1, hf_mode=True, drafter="dflash")
    with pytest.raises(ValueError, match="--mask_token_id"):
        drafters.mask_token_id(hf, types.SimpleNamespace(tok=types.SimpleNamespace(mask_id=None)))
    assert drafters.mask_token_id(hf, types.SimpleNamespace(tok=types.SimpleNamespace(mask_id=7))) == 7
    with pytest.raises(ValueError, match="lacks the drafter protocol"):
        check_drafter(torch.nn.Linear(2, 2))


def test_warmup_key_by_family():
    keys = {}
    for name in ("eagle3", "dflash"):
        cfg = parse_args([f"--drafter={name}", "--num_draft_tokens=3"])
        keys[name] = DraftSpec.from_config(cfg, build_task(cfg), "p").key()
    cfg = parse_args([])  # block fields (refused as flags with eagle3) do not touch an EAGLE-3 warm-up's key
    cfg.block_size, cfg.anchors = 4, 2
    assert DraftSpec.from_config(cfg, build_task(cfg), "p").key() == keys["eagle3"] != keys["dflash"]


@pytest.mark.parametrize("cls", [DFlashDraft, DSparkDraft])
def test_save_load_by_architecture(policy, cls, tmp_path):
    d = cls.from_target(policy, mask_token_id=0, block_size=3)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p))
    d.save(str(tmp_path / "d"))
    e = load_draft(str(tmp_path / "d"), policy)
    assert type(e) is cls and all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), e.state_dict().values()))
    state = (torch.tensor([3, 1]), torch.zeros(2, 4))
    assert [t.tolist() for t in select_rows(state, torch.tensor([1]))] == [[1], [[0.0] * 4]]
