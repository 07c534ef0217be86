"""A draft family's own checkpoint (serving/draft_checkpoint.py, each family's save / load): every family reads back
what it wrote, bit for bit, and a directory that is not one of its checkpoints is one ValueError naming the path.
~2 s on 2 shared cores.
"""
import os

import pytest
import torch

from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from model import ModelConfig, Transformer
from serving.draft_checkpoint import read_draft

MAKE = {"eagle3": Eagle3Draft.from_target,
        "dflash": lambda p: DFlashDraft.from_target(p, mask_token_id=0, block_size=4),
        "dspark": lambda p: DSparkDraft.from_target(p, mask_token_id=0, block_size=4, markov_rank=4)}


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny")).eval()


@pytest.mark.parametrize("family", sorted(MAKE))
def test_every_family_reads_back_what_it_wrote(tmp_path, policy, family):
    draft = MAKE[family](policy)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p))  # not the initial weights
    draft.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temporary file left behind
    back = type(draft).load(str(tmp_path), policy)
    assert back.cfg == draft.cfg
    mine, theirs = draft.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_not_a_checkpoint_is_one_error_naming_the_path(tmp_path, policy):
    with pytest.raises(ValueError, match=r"path='.*': expected a draft directory with config.json"):
        Eagle3Draft.load(str(tmp_path), policy)
    MAKE["eagle3"](policy).save(str(tmp_path))
    with pytest.raises(ValueError, match=r"path='.*': not a CospecDFlashDraft checkpoint"):
        DFlashDraft.load(str(tmp_path), policy)  # another family's
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: invalid JSON \(.* at line 1, column 2\)"):
        read_draft(str(tmp_path))
