"""Several EOS ids (an HF generation config may list two, as Qwen3's does): a row ends at the first token that is any of
them, on every decoding path (plain k = 0, chains, trees, greedy and sampled); the acceptance counters count only the
tokens kept; the tasks expose eos_ids and every caller passes all of them. Adds ~4 s to the suite on a 2-core CPU
(3.3-4.1 s measured, mostly the fixture's draft training and the tiny HF checkpoint)."""
import json
import random
import re
from types import SimpleNamespace

import pytest
import torch

import speculative
from decoding.k_control import KSchedule
from decoding.row_streams import RowStreams, row_keys
from hf_util import EOS, write_jsonl, write_tiny_llama
from model import ModelConfig, Transformer, greedy_generate
from spec_cases import SWITCHING, briefly_trained_draft
from speculative import generate
from tasks.protocol import make_task
from tasks.task import CountUpTask

pytestmark = pytest.mark.usefixtures("one_thread")
N_NEW = 24


def cut(tokens, eos):  # the tokens through the first of any id in eos
    hit = [j for j, t in enumerate(tokens.tolist()) if t in eos]
    return tokens[: hit[0] + 1] if hit else tokens


@pytest.fixture(scope="module")
def case():
    """A tiny fp64 policy whose greedy continuations fall into cycles, a draft trained briefly on them (accepts and
    rejects both run), 6 ragged prompts and two EOS ids taken from the greedy continuations: the first ends rows 1
    and 2, the second (a token of row 0's cycle, so it lands inside accepted draft blocks) ends row 0 only; rows 3-5
    emit neither and run to the budget."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double().eval()
    train = [torch.randint(97, (int(n),), generator=g) for n in torch.randint(2, 6, (12,), generator=g)]
    draft = briefly_trained_draft(policy, train, greedy_generate(policy, train, N_NEW))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(97, (int(n),), generator=g) for n in torch.randint(1, 8, (6,), generator=g)]
    ref = greedy_generate(policy, prompts, N_NEW)
    eos = [int(ref[2][4]), int(ref[0][6])]
    ends = [int(cut(r, eos)[-1]) if len(cut(r, eos)) < N_NEW else None for r in ref]
    assert ends == [eos[1], eos[0], eos[0], None, None, None]
    return policy, draft, prompts, eos


def check_counts(r, n_rows):
    """The acceptance counters count only the tokens kept: one prefill token per row plus `kept`, per row too."""
    st = r.stats
    assert sum(len(t) for t in r.tokens) == st.new_tokens == n_rows + st.kept
    assert st.kept == st.row_steps + st.accepted and sum(st.row_kept) == st.kept
    assert all(len(t) == 1 + kp for t, kp in zip(r.tokens, st.row_kept))


@pytest.mark.parametrize("k, tree", [(0, None), (2, None), (4, None), ("switching", None), (3, (2, 2, 1))])
def test_greedy_rows_end_at_either_id(case, k, tree):
    """T = 0 with two EOS ids: each row is plain greedy decoding cut through the first of either id, token for token;
    row 0 ends at the second id."""
    policy, draft, prompts, eos = case
    adapt, k = (KSchedule(SWITCHING[2]), max(SWITCHING[2])) if k == "switching" else (None, k)
    r = generate(policy, draft, prompts, max_new_tokens=N_NEW, num_draft_tokens=k, temperature=0, eos_id=eos,
                 tree=tree, adapt=adapt)
    assert [t.tolist() for t in r.tokens] == [cut(t, eos).tolist() for t in greedy_generate(policy, prompts, N_NEW)]
    assert r.tokens[0][-1] == eos[1] and len(r.tokens[0]) < N_NEW
    check_counts(r, len(prompts))
    assert not k or 0 < r.stats.accepted < r.stats.drafted  # a draft: accepts and rejects both ran


@pytest.mark.parametrize("k, tree", [(0, None), (3, None), (3, (2, 2, 1))])
def test_sampled_rows_end_at_either_id(case, k, tree):
    """T = 0.7 from per-row streams, 3 samples per prompt: a row's tokens depend on its own stream alone, so with two
    EOS ids each row is its run without EOS cut through the first of either id (log-probs too); both ids end rows."""
    policy, draft, prompts, eos = case
    prompts = prompts * 3
    kw = dict(max_new_tokens=N_NEW, num_draft_tokens=k, temperature=0.7, tree=tree)
    keys = row_keys(5, torch.arange(len(prompts)))
    free = generate(policy, draft, prompts, generator=RowStreams(keys), **kw)
    r = generate(policy, draft, prompts, generator=RowStreams(keys), eos_id=eos, **kw)
    for got, lp, want, want_lp in zip(r.tokens, r.logprobs, free.tokens, free.logprobs):
        assert got.tolist() == cut(want, eos).tolist()
        assert torch.allclose(lp, want_lp[: len(got)], rtol=0, atol=1e-9)
    assert {int(t[-1]) for t in r.tokens if len(t) < N_NEW} == set(eos)
    check_counts(r, len(prompts))


def test_kept_tokens_hand_count():
    """One verification forward, k = 3, EOS ids (9, 7): row 0 accepts 3 and its 2nd token is 7 (the second id): keeps
    2; row 1 accepts 3 and its 3rd token is 9: keeps 3; row 2 accepts 1, and the 7 past its n + 1 tokens was never
    emitted: keeps 2; row 3 is finished: keeps 0."""
    block, n = torch.tensor([[2, 7, 4, 5], [2, 3, 9, 5], [2, 3, 7, 0], [7, 0, 0, 0]]), torch.tensor([3, 3, 1, 3])
    kept = speculative.kept_tokens(block, n, torch.ones(4, dtype=torch.long), torch.arange(4) < 3,
                                   torch.tensor([9, 7]), 20)
    assert kept.tolist() == [2, 3, 2, 0]


def test_eos_id_forms_and_errors(case):
    """eos_id: an int, a list or a tuple (the same rows), [] = None (no EOS); anything else a one-line ValueError."""
    policy, _, prompts, eos = case

    def run(e):
        return [t.tolist() for t in generate(policy, None, prompts, max_new_tokens=8, temperature=0, eos_id=e).tokens]
    assert run(eos) == run(tuple(eos)) and run([]) == run(None) and run([eos[0]]) == run(eos[0])
    for bad in ([3, 97], (3, -1), [3, 2.0], [True], "3", 2.0):
        msg = f"eos_id={bad!r}: expected an int token id in [0, vocab_size=97), a list or tuple of them, or None"
        with pytest.raises(ValueError, match=re.escape(msg)):
            generate(policy, None, prompts, max_new_tokens=2, eos_id=bad)


# ------------------------------------------------------------------------------------------------- tasks and callers
def test_hf_task_passes_every_generation_config_eos_id(tmp_path, monkeypatch):
    """A checkpoint whose generation_config.json lists two EOS ids: HFTask exposes both, and the rollouts, the policy
    eval and the vLLM engine's stop list get both; a greedy rollout row ends at the second."""
    from harness.engine_rollout import engine_generate
    from harness.rollout import generate as rollout_generate
    from harness.warmup import evaluate_policy
    from serving.hf_io import from_pretrained
    from serving.vllm_engine import EngineOutput
    from tasks.hf_task import HFTask

    d = write_tiny_llama(tmp_path / "llama", extra_vocab=3)
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {a} * 3?", "answer": 3 * a} for a in range(10)])
    policy = from_pretrained(str(d)).eval()
    t = HFTask(str(d), data, eval_fraction=0.3, seed=0, max_new_tokens=12)
    probs = t.eval_set()
    prompts = [t.encode_prompt(p) for p in probs]
    greedy = greedy_generate(policy, prompts, 12)
    stop = next(int(x) for x in greedy[0][2:] if x != EOS)  # row 0 emits it; the first id is the checkpoint's </s>
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, stop]}))
    t = HFTask(str(d), data, eval_fraction=0.3, seed=0, max_new_tokens=12)
    assert t.tok.eos_ids == [EOS, stop]
    seen, real = [], speculative.generate
    monkeypatch.setattr(speculative, "generate", lambda *a, **kw: (seen.append(kw["eos_id"]), real(*a, **kw))[1])
    cfg = SimpleNamespace(num_draft_tokens=0, max_draft_tokens=0, rollout_batch=4, temperature=0.0, tree=())
    s = SimpleNamespace(cfg=cfg, adapt=None, policy=policy, gen=torch.Generator(), task=t)
    toks, _, _ = rollout_generate(s, None, prompts, torch.arange(len(prompts)))
    assert [x.tolist() for x in toks] == [cut(g, [EOS, stop]).tolist() for g in greedy]
    assert toks[0][-1] == stop and len(toks[0]) < 12
    evaluate_policy(policy, t, probs, 12, temperature=0.0, rows=4)
    assert seen and all(e == [EOS, stop] for e in seen)
    engine = SimpleNamespace(generate=lambda *a, **kw: (seen.append(kw["stop"]), EngineOutput(
        [[g.tolist()] for g in toks], 0, 0, 1.0))[1])
    engine_generate(SimpleNamespace(cfg=SimpleNamespace(temperature=1.0, no_spec=True), engine=engine, task=t,
                                    policy=policy), prompts, torch.arange(len(prompts)))
    assert seen[-1] == [EOS, stop]


def test_builtin_task_scores_any_eos_id():
    """The built-in task: eos_ids = [eos_id]; its score and decode end a response at any id of eos_ids."""
    t = CountUpTask()
    assert t.tok.eos_ids == [t.tok.eos_id]
    p = t.sample(1, random.Random(0))[0]
    answer, gt = t.tok.encode(f"#{p.answer}"), t.tok.id[">"]
    assert t.score([p], [torch.tensor(answer + [gt])])[0].tolist() == [0.0]  # no EOS: no credit
    t.tok.eos_ids = [t.tok.eos_id, gt]  # a second id that ends a response
    assert t.score([p], [torch.tensor(answer + [gt])])[0].tolist() == [1.0]
    assert t.tok.decode(answer + [gt] + t.tok.encode("99")) == f"#{p.answer}"


def _task_without_eos_ids(cfg):  # its tokenizer has eos_id only
    t = CountUpTask()
    del t.tok.eos_ids
    return t


def test_make_task_wants_eos_ids():
    with pytest.raises(ValueError, match=re.escape("--task=test_eos_ids:_task_without_eos_ids: expected tok.eos_ids")):
        make_task("test_eos_ids:_task_without_eos_ids", SimpleNamespace())
