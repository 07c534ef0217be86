"""A block drafter's inputs refused at config time, before any training, in one line naming the flag:
1. a MASK id the policy can emit (an EOS id -- any of several --, the pad where it is an EOS, an id the task's
   tokenizer writes as text; the built-in task and an HF checkpoint's word-level tokenizer), passed or resolved
   from -1;
2. a k whose fitted block (--block_size=0: W = k + 1, dspark k) leaves --block_size's range [2, 64], named by the
   flag that makes it big (--num_draft_tokens or --eval_draft_tokens).

The cases run config.parse_args, and train.py's main as `python train.py` runs it with the build replaced by a
failure; the HF checkpoints are tokenizer files and a config.json, no weights. Adds under 1 s to the suite on 2 busy
cores (`timeout 600 python -m pytest -q tests/test_bad_inputs_block.py --durations=5`).
"""
import json
import re

import pytest

from harness import drafters
from harness.config import parse_args
from harness.experiment import build_task
from harness.config_checks import BLOCK_MAX
from hf_util import write_jsonl, write_word_tokenizer
from tasks.task import VOCAB
from test_startup_checks import ends_before_the_build

MASK_RULE = "--mask_token_id={}: expected -1 (the tokenizer's mask token, else the task's pad) or an id >= 0"


# ------------------------------------------------------------------------------- 1. a MASK id the policy emits
@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_the_builtin_tasks_emitted_ids_are_refused_as_a_mask(family):
    """<eos> (2) ends every response and the digits and signs (3..17) are its text: none may be the MASK. <pad> (0,
    the default) and <bos> (1) never appear in a response."""
    for i in range(2, len(VOCAB)):
        with pytest.raises(ValueError, match=re.escape(MASK_RULE.format(i))):
            parse_args([f"--drafter={family}", f"--mask_token_id={i}"])
    with pytest.raises(ValueError, match=re.escape(MASK_RULE.format(len(VOCAB)))):  # outside the vocabulary
        parse_args([f"--drafter={family}", f"--mask_token_id={len(VOCAB)}"])
    for i, flags in ((0, []), (0, ["--mask_token_id=0"]), (1, ["--mask_token_id=1"])):
        cfg = parse_args([f"--drafter={family}"] + flags)
        assert drafters.mask_token_id(cfg, build_task(cfg)) == i
    with pytest.raises(ValueError, match=re.escape("--mask_token_id=2: only --drafter dflash / dspark read it")):
        parse_args(["--mask_token_id=2"])  # EAGLE-3 reads no MASK (tests/test_family_flags.py)
    parse_args(["--drafter=dflash", "--mask_token_id=2", "--no_spec"])  # nor does a run without a draft


def test_an_eos_mask_ends_train_py_at_start(monkeypatch, capsys, tmp_path):
    """Was: `--drafter dflash --mask_token_id 2` (the task's <eos>) trained without a word."""
    line = ends_before_the_build(monkeypatch, capsys, ["--preset=test", "--drafter=dflash", "--mask_token_id=2",
                                                        f"--out={tmp_path / 'run'}", f"--cache_dir={tmp_path / 'c'}"])
    assert line.startswith("train.py: " + MASK_RULE.format(2)) and "no EOS id" in line, line
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


WORDS = "What is + ? 0 1 2 3 <|end|>".split()  # ids 4..12 after <pad> <s> </s> <unk>; <|end|> = 12, a second EOS


def hf_checkpoint(tmp_path, tokenizer_config: dict, eos=(2, 12)) -> list:
    """A word-level tokenizer (its special tokens <pad> <s> </s> <unk>, and <|end|> marked special here),
    generation_config's EOS ids `eos`, a config.json; -> the HF-mode flags that name it with a prompts file."""
    path = tmp_path / "ckpt"
    V = write_word_tokenizer(path, WORDS)
    tk = json.loads((path / "tokenizer.json").read_text())
    tk["added_tokens"].append({"id": 12, "content": "<|end|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tk))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    (path / "config.json").write_text(json.dumps({"vocab_size": V + 4, "max_position_embeddings": 512}))
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {a} + 1 ?", "answer": a + 1} for a in range(3)])
    return [f"--model={path}", f"--data={data}", "--drafter=dflash"]


def test_an_hf_checkpoints_emitted_ids_are_refused_as_a_mask(tmp_path):
    """Every EOS id of the generation config (2 and 12: Qwen3's lists two), the pad where the checkpoint has none (HF
    pads with EOS) and any word are refused; a special token that ends nothing (<unk>, 3) or an id past the
    tokenizer in the embedding's padding (13..16) may be the MASK."""
    flags = hf_checkpoint(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    cfg = parse_args(flags + ["--mask_token_id=3"])
    tsk = build_task(cfg)
    assert tsk.tok.eos_ids == [2, 12] and tsk.tok.pad_id == 2  # no pad token: the pad is the first EOS
    assert drafters.mask_token_id(cfg, tsk) == 3
    for i in (2, 12, 4, 7, 11):  # </s>, <|end|>, "What", "0", "3"
        with pytest.raises(ValueError, match=re.escape(MASK_RULE.format(i))):
            parse_args(flags + [f"--mask_token_id={i}"])
    assert parse_args(flags + ["--mask_token_id=15"]).mask_token_id == 15
    with pytest.raises(ValueError, match="the tokenizer has no mask token; pass --mask_token_id=ID"):
        drafters.mask_token_id(parse_args(flags), tsk)  # -1 without a mask token: HF mode has no pad to fall back to


def test_an_hf_mask_token_that_ends_responses_is_refused(tmp_path):
    """-1 takes the tokenizer's mask token; a checkpoint whose mask token is one of its EOS ids is refused as if it had
    been passed."""
    flags = hf_checkpoint(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                     "mask_token": "<|end|>"})
    with pytest.raises(ValueError, match=re.escape(MASK_RULE.format(-1))):
        parse_args(flags)
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>",
                                                                         "mask_token": "<unk>"}))
    cfg = parse_args(flags)
    assert drafters.mask_token_id(cfg, build_task(cfg)) == 3


# ----------------------------------------------------------------------- 2. a fitted block past --block_size's range
@pytest.mark.parametrize("family, most", [("dflash", BLOCK_MAX - 1), ("dspark", BLOCK_MAX)])
def test_a_derived_block_obeys_block_sizes_range(family, most):
    """Was: --drafter dflash --num_draft_tokens 100 with --block_size=0 trained and exported block_size 101, where an
    explicit --block_size is held to [2, 64]."""
    assert parse_args([f"--drafter={family}", f"--num_draft_tokens={most}"]).block_slots == BLOCK_MAX
    for flags, named in ((["--num_draft_tokens=100"], "--num_draft_tokens=100"),
                         ([f"--num_draft_tokens={most + 1}"], f"--num_draft_tokens={most + 1}"),
                         (["--num_draft_tokens=3", "--eval_draft_tokens=100"], "--eval_draft_tokens=100")):
        with pytest.raises(ValueError) as e:
            parse_args([f"--drafter={family}"] + flags)
        msg = str(e.value)
        assert msg.startswith(f"{named}: expected ") and f"at most {BLOCK_MAX - 1} (dspark: {BLOCK_MAX})" in msg
        assert "\n" not in msg and msg.count(": expected") == 1, msg  # one line, the one flag that makes it big
    assert parse_args([f"--drafter={family}", "--block_size=64", f"--num_draft_tokens={most}"]).block_slots == 64
    with pytest.raises(ValueError, match=re.escape("--block_size=65: expected 0 (k + 1; dspark: k, at least 2) or in "
                                                   "[2, 64]")):
        parse_args([f"--drafter={family}", "--block_size=65"])
    assert parse_args(["--num_draft_tokens=100"]).num_draft_tokens == 100  # EAGLE-3 has no block


def test_a_derived_block_too_big_ends_train_py_at_start(monkeypatch, capsys, tmp_path):
    line = ends_before_the_build(monkeypatch, capsys, ["--preset=test", "--drafter=dflash", "--num_draft_tokens=100",
                                                        f"--out={tmp_path / 'run'}", f"--cache_dir={tmp_path / 'c'}"])
    assert line.startswith("train.py: --num_draft_tokens=100: expected >= 1") and "at most 63" in line, line
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()
