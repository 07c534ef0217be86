# ~6 s: a tiny random Llama and its prompts built here, one short HF-mode rollout, the rest string checks.
"""--reward module:function (tasks/hf_reward.py): in HF mode the rollouts are scored by the named function, called as
f(prompt, response, answer), in place of the built-in math-answer rule; every bad input is one line naming --reward,
at config time (the form, the module, the function, callable, the signature; outside HF mode) or at the first score
(a value that is not a finite number, its type named); the reward is in no warm-up's cache key."""
import random
import re
import sys
import textwrap

import pytest
import torch

from harness.config import parse_args
from harness.experiment import build
from harness.mesh import make_mesh
from harness.rollout import rollout
from tasks.hf_task import HFTask, math_answer, math_answer_reward
from hf_util import write_sum_task

REWARDS = """
SEEN = []


def prompt_digits(prompt, response, answer):  # not the math rule: the digits of the prompt, plus 1 per response word
    SEEN.append((prompt, response, answer))
    return sum(c.isdigit() for c in prompt) + len(response.split())


def yes(prompt, response, answer):
    return "yes"


def nan(prompt, response, answer):
    return float("nan")


def tensor(prompt, response, answer):
    return torch.tensor(1.0)


def flag(prompt, response, answer):
    return response == answer  # a bool counts as 1 / 0


def two(prompt, response):
    return 0.0


def keywords_only(*, prompt, response, answer):
    return 0.0


CONST = 3
"""


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_sum_task(tmp_path_factory.mktemp("hf"))


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    """The module `myrewards` written to tmp_path and put on sys.path; a fresh import in every test."""
    (tmp_path / "myrewards.py").write_text("import torch\n" + textwrap.dedent(REWARDS))
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("myrewards", "broken_rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def hf_argv(hf, tmp_path, *more):
    model, data = hf
    return ["--preset", "test", "--model", model, "--data", data, "--max_new_tokens", "10", "--eval_fraction=0.3",
            "--no_spec", "--cache_dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), *more]


def test_the_named_function_scores_the_rollouts(hf, rewards, tmp_path):
    cfg = parse_args(hf_argv(hf, tmp_path, "--reward=myrewards:prompt_digits"))
    mesh = make_mesh(cfg)
    s = build(cfg, mesh, log=lambda *a, **k: None)
    import myrewards
    assert s.task.reward_fn is myrewards.prompt_digits
    problems = s.task.sample(3, random.Random(0))
    batch, info = rollout(s, mesh, problems)  # group_size 4: 12 rows
    cu = batch.cu_seqlens.tolist()
    responses = [s.task.tok.decode(batch.tokens[a:b][batch.resp_mask[a:b]]) for a, b in zip(cu[:-1], cu[1:])]
    want = [(problems[i // 4].prompt, r, problems[i // 4].answer) for i, r in enumerate(responses)]
    assert myrewards.SEEN == want  # prompt text, decoded response, the row's answer (a string)
    R = [2 + len(r.split()) for r in responses]  # "What is a + b ?": two digits
    assert info["reward"] == pytest.approx(sum(R) / len(R)) and max(R) > 1  # not the math rule's 0 / 1


def task(hf, reward=""):
    return HFTask(*hf, max_new_tokens=10, reward=reward)


def test_the_default_is_the_math_answer_rule_and_no_cache_key_holds_the_reward(hf, rewards):
    plain, mine = task(hf), task(hf, "myrewards:flag")
    assert plain.reward_fn is math_answer and plain.fingerprint() == mine.fingerprint()
    p = plain.splits["train"][0]
    responses = [torch.tensor(plain.tok.encode(text)) for text in (p.answer, f"? 5 {p.answer}")]
    assert [math_answer_reward(plain.tok.decode(r), p.answer) for r in responses] == [1.0, 1.0]
    assert plain.score([p, p], responses)[0].tolist() == [1.0, 1.0]
    assert mine.score([p, p], responses)[0].tolist() == [1.0, 0.0]  # response == answer: True, then False


@pytest.mark.parametrize("spec, msg", [
    ("myrewards", "--reward=myrewards: expected module:function"),
    ("myrewards:", "--reward=myrewards:: expected module:function"),
    ("no_such_rewards_mod:f", "--reward=no_such_rewards_mod:f: no module 'no_such_rewards_mod' on PYTHONPATH or in"),
    ("broken_rewards:f", "--reward=broken_rewards:f: importing module 'broken_rewards' raised RuntimeError: boom at"),
    ("myrewards:nope", "--reward=myrewards:nope: module 'myrewards' has no function 'nope'"),
    ("myrewards:CONST", r"--reward=myrewards:CONST: myrewards.CONST is not callable \(its type: int\)"),
    ("myrewards:two", r"--reward=myrewards:two: two\(prompt, response\) cannot be called as two\(prompt, response, "),
    ("myrewards:keywords_only", "--reward=myrewards:keywords_only: keywords_only.* cannot be called as"),
])
def test_a_bad_reward_is_refused_at_config_time_in_one_line(hf, rewards, tmp_path, spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        parse_args(hf_argv(hf, tmp_path, f"--reward={spec}"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fn, what", [("yes", "'yes', of type str,"), ("nan", "nan (not finite)"),
                                      ("tensor", "tensor(1.), of type Tensor,")])
def test_a_reward_that_is_not_a_number_stops_at_the_first_score(hf, rewards, fn, what):
    t = task(hf, f"myrewards:{fn}")
    p = t.splits["train"][0]
    with pytest.raises(ValueError, match=rf"--reward=myrewards:{fn} returned {re.escape(what)} for the data's line "
                                         rf"{p.line}: expected a finite number") as e:
        t.score([p], [torch.tensor(t.tok.encode("1"))])
    assert "\n" not in str(e.value)


def test_outside_hf_mode_the_flag_is_refused(rewards):
    with pytest.raises(ValueError, match=r"--reward=myrewards:flag: expected '' outside HF mode: the built-in task has "
                                         "its own reward"):
        parse_args(["--preset", "test", "--reward=myrewards:flag"])
    assert parse_args(["--preset", "test"]).reward == ""


def test_the_module_is_found_in_the_working_directory(hf, tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "cwd_rewards.py").write_text("def half(prompt, response, answer):\n    return 0.5\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    monkeypatch.delitem(sys.modules, "cwd_rewards", raising=False)
    monkeypatch.chdir(here)
    t = task(hf, "cwd_rewards:half")
    problems = t.splits["train"][:3]
    assert t.score(problems, [torch.tensor([4, 5])] * 3)[0].tolist() == [0.5] * 3
