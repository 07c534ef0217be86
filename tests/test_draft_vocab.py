"""draft_vocab.py: the top-N rule over response tokens, the d2t / t2d maps, and the warm-up building a reduced draft."""
import dataclasses
import random

import pytest
import torch

from tasks import task
from harness import warmup
from serving.draft_vocab import count_tokens, coverage, maps, select_draft_vocab
from model import ModelConfig, Transformer


def test_top_n_by_count_ties_to_the_lower_id_unseen_fill_in_id_order():
    responses = [torch.tensor([7, 7, 7, 2, 2, 9]), torch.tensor([9, 5, 2])]  # counts: 2 -> 3, 7 -> 3, 9 -> 2, 5 -> 1
    assert count_tokens(responses, 10).tolist() == [0, 0, 3, 0, 0, 1, 0, 3, 0, 2]
    assert select_draft_vocab(responses, 10, 1).tolist() == [2]  # 2 and 7 tie: the lower id first
    assert select_draft_vocab(responses, 10, 3).tolist() == [2, 7, 9]
    assert select_draft_vocab(responses, 10, 6).tolist() == [0, 1, 2, 5, 7, 9]  # then unseen ids 0, 1 in id order
    assert coverage(torch.tensor([2, 7, 9]), responses) == pytest.approx(8 / 9)
    for n, match in ((0, "draft_vocab=0"), (11, "draft_vocab=11")):
        with pytest.raises(ValueError, match=match):
            select_draft_vocab(responses, 10, n)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        count_tokens([torch.tensor([10])], 10)


def test_maps_are_the_engines_offsets():
    ids = torch.tensor([1, 4, 5, 9])
    d2t, t2d = maps(ids, 12)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 3, 3, 6]  # target id = draft id + d2t[draft id]
    assert torch.equal(torch.arange(4) + d2t, ids) and t2d.nonzero().flatten().tolist() == ids.tolist()


def test_warm_draft_builds_a_reduced_vocabulary_from_the_policys_responses(tmp_path):
    torch.manual_seed(0)
    tsk = task.CountUpTask(1, 2)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=tsk.tok.vocab_size)).eval()
    spec = warmup.DraftSpec("p", tsk, steps=2, batch=4, lr=1e-3, pool=8, max_new_tokens=6, num_passes=2, seed=0,
                            draft_vocab=6)
    draft, loaded = warmup.warm_draft(policy, spec, cache_dir=str(tmp_path))
    assert not loaded and draft.cfg.draft_vocab_size == 6 and draft.lm_head.weight.shape[0] == 6
    # the same 6 ids as the rule applied to the responses the warm-up sampled (same seed, prompt i's own stream)
    from decoding.row_streams import RowStreams, row_keys
    g = RowStreams(row_keys(1, torch.arange(8)))
    prompts = [tsk.encode_prompt(p) for p in tsk.sample(8, random.Random(1), "train")]
    import speculative
    resp = speculative.generate(policy, None, prompts, max_new_tokens=6, temperature=1.0, eos_id=tsk.tok.eos_id,
                                generator=g).tokens
    assert torch.equal(draft.draft_to_target, select_draft_vocab(resp, policy.cfg.vocab_size, 6))
    again, loaded = warmup.warm_draft(policy, spec, cache_dir=str(tmp_path))
    assert loaded and torch.equal(again.d2t, draft.d2t)  # cached under a key that includes draft_vocab
    full, loaded = warmup.warm_draft(policy, dataclasses.replace(spec, draft_vocab=0), cache_dir=str(tmp_path))
    assert not loaded and full.cfg.draft_vocab_size == policy.cfg.vocab_size
    # --draft_warmup_steps 0: an untrained draft, but its vocabulary costs the pool's sampling: cached too
    zero = dataclasses.replace(spec, steps=0)
    first, loaded = warmup.warm_draft(policy, zero, cache_dir=str(tmp_path))
    assert not loaded and torch.equal(first.draft_to_target, draft.draft_to_target)
    calls = []
    generate = speculative.generate
    speculative.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    try:
        again, loaded = warmup.warm_draft(policy, zero, cache_dir=str(tmp_path))
    finally:
        speculative.generate = generate
    assert loaded and not calls and torch.equal(again.d2t, first.d2t)  # loaded, nothing sampled


def test_config_draft_vocab_is_checked():
    from harness.config import parse_args
    assert parse_args([]).draft_vocab == 0 and parse_args(["--draft_vocab=12"]).draft_vocab == 12
    with pytest.raises(ValueError, match="draft_vocab=-1"):
        parse_args(["--draft_vocab=-1"])
