"""hf_task.py: a tiny BPE tokenizer and a tiny random Llama built here (nothing downloaded) -> special tokens, round
trip, vocab check, jsonl errors by line, the split, the math-answer reward by hand, greedy/speculative decoding e2e."""
import json
import random
import shutil
import sys

import pytest
import torch

from tasks.hf_task import HFTask, HFTokenizer, extract_answer, load_jsonl, math_answer_reward
from hf_util import BOS, EOS, PAD, write_jsonl, write_tiny_llama, write_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """tokenizer.json + tokenizer_config.json + a bare config.json (HFTask reads only vocab_size from it)."""
    d = tmp_path_factory.mktemp("tok")
    V = write_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"vocab_size": V + 4}))
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a in range(6) for b in range(5)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "p.jsonl", rows)


def test_tokenizer_round_trip_and_special_tokens(tok_dir, data):
    t = HFTask(str(tok_dir), data)
    tok = t.tok
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (BOS, EOS, [EOS], PAD)  # from tokenizer_config
    for text in ["What is 12 + 30?", "  spaces\tand\nnewlines ", "caf\u00e9 \u20ac5 \u2212 \\frac{1}{2}", ""]:
        ids = tok.encode(text)
        assert BOS not in ids and tok.decode(ids) == text
    ids = tok.encode("12 + 30")
    assert tok.decode([BOS] + ids + [PAD, EOS] + tok.encode("junk")) == "12 + 30"  # EOS ends it, BOS/PAD dropped
    assert tok.decode(torch.tensor(ids)) == "12 + 30"
    p = t.encode_prompt(t.splits["train"][0])
    assert p.dtype == torch.long and p[0] == BOS and (p == BOS).sum() == 1  # post-processor + add_bos: one BOS
    assert tok.decode(p) == t.splits["train"][0].prompt


def test_special_tokens_precedence_and_fallbacks(tok_dir, data, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    (d / "config.json").write_text(json.dumps({"vocab_size": 400, "eos_token_id": 7, "bos_token_id": BOS}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 9]}))
    tok = HFTask(str(d), data).tok
    assert tok.eos_ids == [EOS, 9] and tok.eos_id == EOS  # generation_config wins over config.json
    assert tok.decode(tok.encode("ab") + [9] + tok.encode("cd")) == "ab"  # any EOS ends the text
    (d / "generation_config.json").unlink()
    assert HFTask(str(d), data).tok.eos_ids == [7]  # then config.json
    write_tokenizer(d, {"eos_token": "</s>"})  # no pad anywhere: pad with EOS; no add_bos_token: post-processor only
    (d / "config.json").write_text(json.dumps({"vocab_size": 400}))
    t = HFTask(str(d), data)
    assert (t.tok.pad_id, t.tok.bos_id, t.tok.add_bos) == (EOS, None, False)
    assert t.encode_prompt(t.splits["train"][0])[0] == BOS  # tokenizer.json's TemplateProcessing still adds <s>
    write_tokenizer(d, {})
    with pytest.raises(ValueError, match="no EOS token"):
        HFTask(str(d), data)
    write_tokenizer(d, {"eos_token": "<|end|>"})
    with pytest.raises(ValueError, match="not in tokenizer.json's vocabulary"):
        HFTask(str(d), data)
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTask(str(d), data)


def test_vocab_larger_than_the_model_is_an_error(tok_dir, data, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    V = HFTask(str(tok_dir), data).tok.vocab_size
    (d / "config.json").write_text(json.dumps({"vocab_size": V}))
    assert HFTask(str(d), data).model_vocab_size == V  # equal is fine
    (d / "config.json").write_text(json.dumps({"vocab_size": V - 1}))
    with pytest.raises(ValueError, match=f"ids up to {V - 1}.*vocab_size={V - 1}"):
        HFTask(str(d), data)
    (d / "config.json").write_text(json.dumps({"vocab_size": V + 10}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, V + 10]}))
    with pytest.raises(ValueError, match=rf"special token ids \[{V + 10}\] are outside the model's vocab_size={V + 10}"):
        HFTask(str(d), data)
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no vocab_size"):
        HFTask(str(d), data)


@pytest.mark.parametrize("lines, where, msg", [
    (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b", "answer": 2'], 3, "invalid JSON"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'], 2, "missing field 'answer'"),
    (['{"answer": "1"}'], 1, "missing field 'prompt'"),
    (['["a", "1"]'], 1, "expected a JSON object"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "  ", "answer": "1"}'], 2, "'prompt' must be a non-empty string"),
    (['{"prompt": "a", "answer": true}'], 1, "'answer' must be"),
    (['{"prompt": "a", "answer": ""}'], 1, "'answer' must be"),
    (['{"prompt": "a", "answer": null}'], 1, "'answer' must be"),
])
def test_bad_jsonl_names_the_line(tmp_path, lines, where, msg):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=f"bad.jsonl:{where}: {msg}"):
        load_jsonl(path)


def test_jsonl_empty_missing_and_good(tmp_path):
    for text in ["", "\n  \n"]:
        (tmp_path / "e.jsonl").write_text(text)
        with pytest.raises(ValueError, match="holds no examples"):
            load_jsonl(str(tmp_path / "e.jsonl"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_jsonl(str(tmp_path / "nope.jsonl"))
    ex = load_jsonl(write_jsonl(tmp_path / "g.jsonl", ['{"prompt": "a", "answer": 3}', "",
                                                       '{"prompt": "b", "answer": "x", "id": 7}']))
    assert [(e.prompt, e.answer, e.line) for e in ex] == [("a", "3", 1), ("b", "x", 3)]


def test_split_sampling_and_prompt_length(tok_dir, data, tmp_path):
    t = HFTask(str(tok_dir), data, eval_fraction=0.2, seed=3)
    train, ev = t.splits["train"], t.splits["eval"]
    assert len(train) + len(ev) == 30 and len(ev) == 6 and not {e.prompt for e in train} & {e.prompt for e in ev}
    assert ev == HFTask(str(tok_dir), data, eval_fraction=0.2, seed=3).splits["eval"]  # the split is the seed's
    assert ev != HFTask(str(tok_dir), data, eval_fraction=0.2, seed=4).splits["eval"]
    s = t.sample(24, random.Random(0))
    assert len({e.line for e in s}) == 24 and s == t.sample(24, random.Random(0))  # distinct within a pass; seeded
    s = t.sample(50, random.Random(1))
    assert {e.line for e in s[:24]} == {e.line for e in train} and all(e in train for e in s)  # then a new pass
    assert set(t.sample(6, random.Random(0), "eval")) == set(ev) and t.eval_set() == ev
    assert t.eval_set(3) == t.eval_set(3) and len(t.eval_set(3)) == 3 and set(t.eval_set(3)) <= set(ev)
    with pytest.raises(ValueError, match="split='test'"):
        t.sample(1, random.Random(0), "test")
    # duplicates of a prompt land on one side
    dup = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i % 4}", "answer": i % 4} for i in range(40)])
    t = HFTask(str(tok_dir), dup, eval_fraction=0.25)
    assert len(t.splits["eval"]) == 10 and len({e.prompt for e in t.splits["eval"]}) == 1
    assert HFTask(str(tok_dir), dup, eval_fraction=0.0).splits["eval"] == []
    with pytest.raises(ValueError, match="eval_fraction=1"):
        HFTask(str(tok_dir), dup, eval_fraction=1)
    with pytest.raises(ValueError, match="cannot leave a train split"):
        HFTask(str(tok_dir), write_jsonl(tmp_path / "one.jsonl", [{"prompt": "q", "answer": 1}]))
    # too-long prompts are dropped, not truncated
    rows = [{"prompt": "What is 1 + 2?", "answer": 3}] * 3 + [{"prompt": "What is 1 + 2? " * 20, "answer": 3}] * 2
    t = HFTask(str(tok_dir), write_jsonl(tmp_path / "l.jsonl", rows), eval_fraction=0.0, max_prompt_tokens=16)
    assert t.dropped == 2 and len(t.splits["train"]) == 3
    with pytest.raises(ValueError, match="exceed max_prompt_tokens=2"):
        HFTask(str(tok_dir), write_jsonl(tmp_path / "l.jsonl", rows), max_prompt_tokens=2)


@pytest.mark.parametrize("text, want", [
    ("so the result is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}} end", "\\frac{3}{4}"),  # the last box, nested braces kept
    ("\\boxed{7} ... #### 9", "7"),  # a box beats '####'
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,234\nsome trailing text 5", "1,234"),
    ("Answer: -3", "-3"),
    ("The final answer is: **$18** dollars.", "18"),
    ("I think the answer is Paris.", "Paris"),
    ("the answer is 5x+3", "5x+3"),  # not trimmed to "5"
    ("10 - 3 = 7 apples", "7"),
    ("we get x = -2", "-2"),
    ("first 3, then 10-3", "3"),  # a minus after a digit is subtraction, not a sign
    ("it costs $1,000.50 in total", "1,000.50"),
    ("half is 1/2", "1/2"),
    ("minus \u22127", "-7"),  # unicode minus
    ("no numbers here", None),
    ("unbalanced \\boxed{3 and then 4", "4"),  # a broken box is skipped
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("response, answer, want", [
    ("\\boxed{42}", "42", 1.0), ("\\boxed{42}", 42, 1.0), ("\\boxed{41}", "42", 0.0),
    ("#### 0.5", "1/2", 1.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{\\dfrac{6}{4}}", "3/2", 1.0),
    ("\\boxed{3.0}", "3", 1.0), ("The answer is 3.", 3.0, 1.0), ("The answer is 3.01", "3", 0.0),
    ("#### 1,000", "1000", 1.0), ("the answer is 1000", "1,000", 1.0), ("The answer is $5.", "5", 1.0),
    ("\\boxed{\\$5}", "$5", 1.0), ("\\boxed{-7}", "-7", 1.0), ("\\boxed{7}", "-7", 0.0), ("Answer: \u22127", "-7", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0), ("\\boxed{(1,2)}", "12", 0.0),  # a pair is not a thousands separator
    ("Answer: Paris.", "paris", 1.0), ("Answer: Rome", "Paris", 0.0), ("\\boxed{\\text{ B }}", "b", 1.0),
    ("She has 5 apples and buys 2, so 7", "7", 1.0), ("She has 7 apples, gives 2, so 5", "7", 0.0),
    ("I don't know", "7", 0.0), ("\\boxed{}", "", 0.0), ("\\boxed{1/0}", "1/0", 1.0), ("\\boxed{1/0}", "0", 0.0),
    ("50%", "50", 1.0),
    ("Janet earns 9*2 = $18.", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = $18.\n#### 18", 1.0),  # GSM8K reference
    ("so 17", "Janet sells ... #### 18", 0.0),
    ("\\boxed{4}", "we get \\boxed{4}", 1.0),
])
def test_math_answer_reward(response, answer, want):
    assert math_answer_reward(response, answer) == want


def test_end_to_end_on_a_tiny_random_llama(tok_dir, tmp_path):
    """HF checkpoint -> hf_io -> prompts from HFTask -> greedy and speculative(no draft) decoding -> rewards."""
    from serving.hf_io import from_pretrained
    from model import greedy_generate
    import speculative

    d = write_tiny_llama(tmp_path / "llama", extra_vocab=3)
    V = HFTokenizer(str(tok_dir)).vocab_size
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {a} * 3?", "answer": 3 * a} for a in range(10)])
    policy = from_pretrained(str(d)).eval()
    t = HFTask(str(d), data, eval_fraction=0.3, seed=0, max_new_tokens=16)  # context 256
    assert t.model_vocab_size == policy.cfg.vocab_size == V + 3 and t.tok.eos_id == EOS  # config.json's ids
    probs = t.eval_set()
    prompts = [t.encode_prompt(p) for p in probs]
    greedy = greedy_generate(policy, prompts, 12)

    # make a token the greedy row 0 emits the EOS, so stopping and the decode cut are exercised on real output
    stop = int(greedy[0][4])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    t = HFTask(str(d), data, eval_fraction=0.3, seed=0, max_new_tokens=16)  # context 256
    assert t.tok.eos_id == stop and t.eval_set() == probs
    out = speculative.generate(policy, None, prompts, max_new_tokens=12, temperature=0.0, eos_id=t.tok.eos_id)
    for g, s in zip(greedy, out.tokens):
        ends = (g == stop).nonzero()
        n = int(ends[0]) + 1 if len(ends) else g.numel()
        assert torch.equal(s, g[:n])  # the same tokens, stopped at the first EOS
        assert t.tok.decode(s) == t.tok.decode(g)
    assert out.tokens[0][-1] == stop

    R, parts = t.score(probs, out.tokens)
    assert R.shape == (len(probs),) and torch.equal(parts["correct"], R)
    assert R.tolist() == [math_answer_reward(t.tok.decode(s), p.answer) for p, s in zip(probs, out.tokens)]
    right = [torch.tensor(t.tok.encode(f"{p.prompt} Answer: {p.answer}") + [stop]) for p in probs]
    wrong = [torch.tensor(t.tok.encode(f"#### {int(p.answer) + 1}") + [stop] + t.tok.encode(p.answer)) for p in probs]
    assert t.score(probs, right)[0].tolist() == [1.0] * len(probs)
    assert t.score(probs, wrong)[0].tolist() == [0.0] * len(probs)  # the answer after EOS does not count


# ------------------------------------------------------------------------ jsonl / parquet, keys, chat templates
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def _chat_dir(tmp_path, template=TEMPLATE):
    d = tmp_path / "chat_tok"
    write_tokenizer(d, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True,
                        **({"chat_template": template} if template else {})})
    (d / "config.json").write_text(json.dumps({"vocab_size": 400, "max_position_embeddings": 64}))
    return d


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_parquet_rows_with_nested_keys_read_like_jsonl(tmp_path):
    rows = [{"question": f"What is {a} + 1?", "reward_model": {"ground_truth": str(a + 1)}, "id": a} for a in range(8)]
    pq_path = _parquet(tmp_path / "p.parquet", rows)
    js_path = write_jsonl(tmp_path / "p.jsonl", rows)
    kw = dict(prompt_key="question", answer_key="reward_model.ground_truth", max_new_tokens=8)
    a, b = (HFTask(str(_chat_dir(tmp_path)), p, **kw) for p in (pq_path, js_path))
    assert a.splits == b.splits and a.splits["train"][0].answer == str(int(a.splits["train"][0].prompt[8]) + 1)
    with pytest.raises(ValueError, match=r"p.parquet:1: missing field 'answer' \(--answer_key"):
        HFTask(str(_chat_dir(tmp_path)), pq_path, prompt_key="question", max_new_tokens=8)
    with pytest.raises(ValueError, match=r"p.jsonl:1: missing field 'prompt' \(--prompt_key"):
        HFTask(str(_chat_dir(tmp_path)), js_path, max_new_tokens=8)
    empty = _parquet(tmp_path / "e.parquet", [])
    with pytest.raises(ValueError, match="e.parquet.*holds no examples"):
        load_jsonl(empty)


def test_parquet_without_pyarrow_or_pandas_names_the_extra(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "p.parquet", [{"prompt": "a", "answer": 1}])
    for mod in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"p.parquet.*pyarrow.*\.\[parquet\]"):
        load_jsonl(path)


def test_chat_prompts_render_with_the_checkpoints_template(tmp_path):
    d = _chat_dir(tmp_path)
    data = write_jsonl(tmp_path / "c.jsonl", [{"prompt": CHAT, "answer": 5}, {"prompt": "plain 1 + 1", "answer": 2},
                                              {"prompt": [{"role": "user", "content": "4 - 1?"}], "answer": 3}])
    t = HFTask(str(d), data, eval_fraction=0.0, max_new_tokens=8)
    ex = {e.line: e for e in t.splits["train"]}
    assert ex[1].chat and ex[1].prompt == "<s><|system|>Be brief.</s><|user|>What is 2 + 3?</s><|assistant|>"
    assert not ex[2].chat and ex[2].prompt == "plain 1 + 1"  # strings are fed as they are
    ids = t.encode_prompt(ex[1]).tolist()
    assert ids[0] == BOS and ids.count(BOS) == 1  # the template's <s>, none added on top
    assert t.encode_prompt(ex[2]).tolist()[0] == BOS  # the post-processor's for a plain prompt
    forced = tmp_path / "t.jinja"
    forced.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    t2 = HFTask(str(d), data, eval_fraction=0.0, max_new_tokens=8, chat_template=str(forced))
    assert {e.line: e.prompt for e in t2.splits["train"]}[1] == "Be brief.\nWhat is 2 + 3?\n"
    with pytest.raises(ValueError, match=r"c.jsonl:1: 'prompt' is a chat .* no chat template"):
        HFTask(str(d), data, max_new_tokens=8, chat_template="none")
    with pytest.raises(ValueError, match=r"c.jsonl:1: 'prompt' is a chat .* no chat template"):
        HFTask(str(_chat_dir(tmp_path / "b", template=None)), data, max_new_tokens=8)
    with pytest.raises(ValueError, match="chat_template='nope'"):
        HFTask(str(d), data, max_new_tokens=8, chat_template="nope")


def test_template_errors_name_the_line(tmp_path, monkeypatch):
    d = _chat_dir(tmp_path)
    bad_role = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "ok", "answer": 1},
                                                  {"prompt": [{"role": "tool", "content": "x"}], "answer": 1}])
    with pytest.raises(ValueError, match=r"r.jsonl:2: the chat template .* cannot render.*unknown role tool"):
        HFTask(str(d), bad_role, max_new_tokens=8)
    bad_msg = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user"}], "answer": 1}])
    with pytest.raises(ValueError, match=r"m.jsonl:1: a chat prompt is a non-empty list"):
        HFTask(str(d), bad_msg, max_new_tokens=8)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": CHAT, "answer": 5}])
    with pytest.raises(ValueError, match="does not parse"):
        HFTask(str(d), chat, max_new_tokens=8, chat_template="{% for m in messages %}")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"jinja2.*\.\[chat\]"):
        HFTask(str(d), chat, max_new_tokens=8)


def test_prompt_longer_than_the_context_is_an_error(tmp_path):
    d = _chat_dir(tmp_path)  # max_position_embeddings 64
    data = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "short", "answer": 1},
                                              {"prompt": "What is 12 + 30? " * 6, "answer": 1}])
    with pytest.raises(ValueError, match=r"l.jsonl:2: a prompt of \d+ tokens \+ max_new_tokens=40 exceeds the model's "
                                         r"context \(max_position_embeddings=64\)"):
        HFTask(str(d), data, max_new_tokens=40)
    assert HFTask(str(d), data, max_new_tokens=40, max_prompt_tokens=10, eval_fraction=0).dropped == 1  # dropped first


def test_rendering_equals_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers", reason="compares with transformers' apply_chat_template")
    d = _chat_dir(tmp_path)
    tk = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>",
                                              eos_token="</s>", pad_token="<pad>")
    from tasks.hf_data import ChatTemplate
    for template in (TEMPLATE, "{% for m in messages %}{{ m | tojson }}{% endfor %}{{ '<gen>' if add_generation_prompt }}"):
        want = tk.apply_chat_template(CHAT, chat_template=template, tokenize=False, add_generation_prompt=True)
        got = ChatTemplate(template, "test", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
        assert got.render(CHAT, "here") == want
