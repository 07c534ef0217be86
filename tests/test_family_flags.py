"""A flag only another draft family reads is refused at config time, in one line naming the families that read it
(config_checks.check_family_flags, from harness/drafters.FAMILIES' flags): the block flags with --drafter eagle3,
--markov_rank and --confidence_threshold outside dspark, EAGLE-3's TTT, draft-vocabulary and tree flags with a block
drafter. The right family takes each; a run from a block draft's folder keeps the file's block fields; `python
train.py` ends before any build. Adds under 1 s to the suite on 2 cores (0.2-0.3 s measured, `timeout 600 python -m
pytest -q tests/test_family_flags.py`; ~4 s more for the imports when run alone).
"""
import re

import pytest
import torch

from harness import drafters
from harness.config import Config, parse_args
from format_cases import FAMILIES as MAKE
from model import ModelConfig, Transformer
from test_startup_checks import ends_before_the_build

BLOCK, DSPARK, EAGLE3 = ("dflash", "dspark"), ("dspark",), ("eagle3",)
# flag: (a value off its default the readers take, the families that read it, the flags it needs beside it)
FLAGS = {
    "block_size": ("8", BLOCK, []), "draft_layers": ("2", BLOCK, []), "anchors": ("3", BLOCK, []),
    "block_gamma": ("2.5", BLOCK, []), "mask_token_id": ("1", BLOCK, []), "markov_rank": ("4", DSPARK, []),
    "confidence_threshold": ("0.3", DSPARK, []), "ttt_passes": ("2", EAGLE3, []), "ttt_decay": ("0.5", EAGLE3, []),
    "draft_vocab": ("8", EAGLE3, []), "tree": ("2,1", EAGLE3, ["--num_draft_tokens=2"]),
}
CASES = [(flag, fam) for flag in FLAGS for fam in drafters.FAMILIES]


def line(flags: str, readers: tuple, drafter: str, many: bool = False) -> str:
    verb = "read" if len(readers) > 1 else "reads"
    return f"{flags}: only --drafter {' / '.join(readers)} {verb} {'them' if many else 'it'} " \
           f"(this run's --drafter is {drafter})"


def test_the_registry_names_each_flags_readers():
    """FAMILIES' options (through OPTION_FLAGS) and own_flags give exactly the table above; every option has its
    flag, or None where the whole run reads it (seed)."""
    readers = {}
    for name, fam in drafters.FAMILIES.items():
        assert set(fam.build_keys + fam.loss_keys) <= set(drafters.OPTION_FLAGS), name
        for flag in fam.flags:
            readers.setdefault(flag, []).append(name)
    assert {k: tuple(v) for k, v in readers.items()} == {k: r for k, (_, r, _) in FLAGS.items()}


@pytest.mark.parametrize("flag,family", CASES)
def test_each_flag_is_refused_outside_its_families_and_taken_inside(flag, family):
    value, readers, extra = FLAGS[flag]
    argv = [f"--drafter={family}", f"--{flag}={value}"] + extra
    if family in readers:
        cfg = parse_args(argv)
        assert str(getattr(cfg, flag)).replace(" ", "").strip("()") == value, getattr(cfg, flag)
    else:
        with pytest.raises(ValueError, match="^" + re.escape(line(f"--{flag}={value}", readers, family)) + "$"):
            parse_args(argv)


def test_every_offending_flag_in_one_line():
    """Was: these ran with metrics identical to the same runs without them."""
    with pytest.raises(ValueError) as e:
        parse_args(["--drafter", "eagle3", "--block_size", "8", "--anchors", "3", "--mask_token_id", "5"])
    assert str(e.value) == line("--block_size=8, --anchors=3, --mask_token_id=5", BLOCK, "eagle3", many=True)
    with pytest.raises(ValueError) as e:
        parse_args(["--drafter", "dflash", "--markov_rank", "4"])
    assert str(e.value) == line("--markov_rank=4", DSPARK, "dflash")
    with pytest.raises(ValueError) as e:  # two groups of readers: each named, the run's family once
        parse_args(["--block_size=8", "--markov_rank=4", "--ttt_passes=2"])
    assert str(e.value) == ("--block_size=8: only --drafter dflash / dspark read it; --markov_rank=4: only --drafter "
                            "dspark reads it (this run's --drafter is eagle3)")
    with pytest.raises(ValueError, match=re.escape(line("--ttt_passes=2, --tree=2,1", EAGLE3, "dspark", many=True))):
        Config(drafter="dspark", ttt_passes=2, tree=(2, 1), num_draft_tokens=2)  # the dataclass itself too


def test_shared_flags_and_defaults_pass_for_every_family():
    """A flag every family reads (the seed is also the block loss's anchors' seed), and a family flag given at its
    default, are not refused."""
    for fam in drafters.FAMILIES:
        parse_args([f"--drafter={fam}", "--seed=3", "--tap_layers=0,1,2", "--block_size=0", "--ttt_passes=3",
                    "--mask_token_id=-1", "--tree=", "--confidence_threshold=0"])


def test_a_value_out_of_range_keeps_its_range_error():
    """--confidence_threshold has one family rule (this one) beside its range row."""
    with pytest.raises(ValueError, match=re.escape("--confidence_threshold=1.5: expected in [0, 1]")):
        parse_args(["--drafter=dflash", "--confidence_threshold=1.5"])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_a_run_from_a_block_draft_folder_keeps_the_files_fields(family, tmp_path):
    """The file's block_size, mask_token_id, draft_layers (and markov_rank) differ from the defaults: they are its
    family's, not flags of another, in each format the draft writes (the vLLM / speculators export, draft.save)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", qk_norm=True)).eval()
    d = MAKE[family](policy)
    d.export(str(tmp_path / "e"), dtype=torch.float32)
    d.save(str(tmp_path / "s"))
    for path in (tmp_path / "e", tmp_path / "e" / "speculators", tmp_path / "s"):
        if not (path / "config.json").is_file():
            continue  # dspark's export is the speculators format at the top
        for drafter in ([], ["--drafter=auto"], [f"--drafter={family}"]):
            cfg = parse_args(["--preset=test", f"--draft={path}", "--num_draft_tokens=3"] + drafter)
            assert (cfg.drafter, cfg.block_size, cfg.mask_token_id, cfg.draft_layers) == (family, 4, 0, 2), path
    other = {"dflash": ("--markov_rank=8", DSPARK), "dspark": ("--ttt_passes=2", EAGLE3)}[family]
    with pytest.raises(ValueError, match="^" + re.escape(line(other[0], other[1], family)) + "$"):
        parse_args(["--preset=test", f"--draft={tmp_path / 's'}", "--num_draft_tokens=3", other[0]])


def test_train_py_ends_before_the_build(monkeypatch, capsys, tmp_path):
    got = ends_before_the_build(monkeypatch, capsys, ["--preset=test", "--drafter", "eagle3", "--block_size", "8",
                                                       "--anchors", "3", "--mask_token_id", "5",
                                                       f"--out={tmp_path / 'run'}", f"--cache_dir={tmp_path / 'c'}"])
    assert got == "train.py: " + line("--block_size=8, --anchors=3, --mask_token_id=5", BLOCK, "eagle3", many=True)
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()
