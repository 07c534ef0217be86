"""The built-in task: tokenizer round trip, demonstrations correct in both styles, the reward, the held-out split."""
import random

import pytest
import torch

from tasks import task
from tasks.task import Problem, ProblemSource, Tokenizer, demo_response, reward


def test_tokenizer_round_trip_and_errors():
    tok = Tokenizer()
    ids = tok.encode("37+17>100=")
    assert tok.decode(ids) == "37+17>100="
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id] + tok.encode("99")) == "37+17>100="  # <eos> ends the text
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("12*3")


def test_problem_and_demo_styles_by_hand():
    rng = random.Random(0)
    p = Problem(37, 17, 100)  # 54, 71, 88, 105 > 100
    assert p.chain == [54, 71, 88, 105] and p.answer == 105 and p.prompt == "37+17>100="
    assert demo_response(p, 1.0, rng) == "37+17=54;54+17=71;71+17=88;88+17=105;#105"
    assert demo_response(p, 0.0, rng) == "54;71;88;105;#105"
    assert Problem(10, 11, 21).chain == [21, 32]  # "> L", not ">= L"
    assert Problem(10, 11, 5).prompt == "10+11>005="  # L always has 3 digits


@pytest.mark.parametrize("p_explicit", [0.0, 0.3, 1.0])
def test_demos_always_earn_full_correctness(p_explicit):
    rng = random.Random(1)
    src = ProblemSource(1, 9)
    for p in src.sample(200, rng):
        text = demo_response(p, p_explicit, rng)
        R, parts = reward(p, text, ended=True, format_weight=0.5)
        assert parts["correct"] == 1.0
        if p_explicit in (0.0, 1.0):
            assert parts["explicit"] == p_explicit
        assert R == pytest.approx(1.0 + 0.5 * parts["explicit"])
        assert len(text) + 1 <= task.max_response_tokens(9)


def test_reward_rejects_wrong_unfinished_and_fake_explicit_steps():
    p = Problem(37, 17, 100)
    good = "37+17=54;54+17=71;71+17=88;88+17=105;#105"
    assert reward(p, good, True, 0.5)[0] == 1.5
    assert reward(p, good, False, 0.5)[0] == 0.0  # hit the token limit: no credit, the format term is gated
    assert reward(p, good[:-1] + "6", True, 0.5)[0] == 0.0  # wrong answer
    assert reward(p, good[:-1] + "6", True, 0.5)[1] == {"correct": 0.0, "explicit": 1.0}
    assert reward(p, "54;71;88;105;", True, 0.5)[0] == 0.0  # no answer at all
    # a well-formed explicit step with wrong numbers earns no format credit; a mixed response earns its share
    R, parts = reward(p, "37+17=54;54+18=71;88;88+17=105;#105", True, 0.5)
    assert parts["correct"] == 1.0 and parts["explicit"] == pytest.approx(2 / 4) and R == pytest.approx(1.25)


def test_split_is_disjoint_and_eval_set_is_fixed():
    src = ProblemSource(4, 7)
    train = src.sample(2000, random.Random(0), "train")
    ev = src.eval_set(200)
    key = lambda p: (p.x0, p.d, p.limit)  # noqa: E731
    assert not ({key(p) for p in train} & {key(p) for p in ev})
    assert all(src.is_eval(p) for p in ev) and not any(src.is_eval(p) for p in train)
    assert ev == src.eval_set(200)
    assert {p.n_steps for p in train} == {4, 5, 6, 7}
    with pytest.raises(ValueError, match="split"):
        src.sample(1, random.Random(0), "test")
    with pytest.raises(ValueError, match="min_steps"):
        ProblemSource(5, 4)


def test_score_on_token_tensors():
    tok = Tokenizer()
    probs = [Problem(37, 17, 100), Problem(10, 20, 25)]
    r0 = torch.tensor(tok.encode("37+17=54;54+17=71;71+17=88;88+17=105;#105") + [tok.eos_id])
    r1 = torch.tensor(tok.encode("30;#30"))  # right answer but no <eos>
    R, parts = task.score(tok, probs, [r0, r1], format_weight=0.5)
    assert R.tolist() == [1.5, 0.0] and parts["correct"].tolist() == [1.0, 0.0]
