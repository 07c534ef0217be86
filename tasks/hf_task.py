"""HF mode task: prompts from a jsonl / parquet file, an HF checkpoint's own tokenizer, a verifiable math reward.

The built-in task (task.py) brings its own tiny tokenizer and problem generator; with a real checkpoint the prompts come
from a file and the tokens from the checkpoint's tokenizer.json (the `tokenizers` library, no transformers needed).
Each row holds a prompt and an answer (keys --prompt_key / --answer_key, default "prompt" / "answer"); a string prompt
is fed as plain text, a chat prompt ([{"role": ..., "content": ...}]) is rendered with the checkpoint's chat template
(hf_data.py; --chat_template forces another or `none`). A prompt plus the response budget must fit the model's context.

The reward is R = 1[extract(response) == answer], with the final answer taken, in order of preference, from the last
\\boxed{...}, the last "#### x", the last "answer: x" / "the answer is x", else the last number in the text. Numbers are
compared as exact fractions (1/2 == 0.5 == \\frac{1}{2}, 3.0 == 3, 1,000 == 1000, $5 == 5), anything else as normalised
strings; a number may carry an exponent (1e-6 == 0.000001, so a JSON answer 1e-06 or 1e+20 can be matched). The
reference may be a bare answer or a GSM8K-style solution ending in "#### x". The data must mean one answer per
prompt: the same prompt twice with answers that do not compare equal is an error at load time. That rule is the
default reward function, math_answer(prompt, response, answer) -> float; --reward=module:function puts yours in its
place, with the same signature (hf_reward.py).

    python -m tasks.hf_task MODEL_DIR prompts.jsonl     # prints the split sizes, special tokens, a few encoded prompts

Usage (the same interface as task.CountUpTask, so the experiment runs on either):
    t = HFTask(model_dir, "prompts.jsonl", prompt_key="prompt", answer_key="answer", chat_template="", reward="")
    problems = t.sample(8, random.Random(0))            # or t.eval_set(64): the fixed held-out split
    prompts = [t.encode_prompt(p) for p in problems]    # 1-D LongTensors, BOS as the tokenizer wants it
    R, parts = t.score(problems, responses)             # responses: generated ids, maybe ending in one of t.tok.eos_ids
"""
from __future__ import annotations

import os
import random
import re
import sys
from fractions import Fraction

import torch
from tokenizers import Tokenizer as _HFTokenizer

from parallel.cli import read_json
from tasks.hf_data import ChatTemplate, Example, file_sha256, load_examples
from tasks.hf_reward import load_reward, reward_value


# -------------------------------------------------------------------------------------------------- the reward
def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at text[start] == '{', nesting respected; None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1: i]
    return None


# 12, -3.5, 1,234, .5, 3/4, 1e-6, 2.5E+20; a minus only as a sign (not the one in "10-3")
_NUM = r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+(?![\w.]))?(?:/\d+)?"
_HASHES = re.compile(r"####\s*([^\n]*)")
_PHRASE = re.compile(r"\banswer\s*(?:is\s*:?|:)\s*([^\n]*)", re.IGNORECASE)
_LEADING_NUM = re.compile(r"[\s*:$]*(" + _NUM + r")(?![\w/^])")  # "**$18** dollars." -> 18


def extract_answer(text: str) -> str | None:
    """The final answer in a response, or None: last \\boxed{..}, else last '#### x', else last 'answer: x' /
    'the answer is x' (trimmed to its leading number if it starts with one: '18 dollars.' -> '18'), else last number."""
    starts = [m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for s in reversed(starts):
        inner = _braced(text, s)
        if inner is not None:
            return inner.strip()
    for pattern in (_HASHES, _PHRASE):
        hits = [m.group(1) for m in pattern.finditer(text)]
        if hits:
            span = hits[-1].strip()
            m = _LEADING_NUM.match(span.replace("\u2212", "-"))
            return m.group(1) if m else span.strip("*: ").rstrip(".")
    nums = re.findall(_NUM, text.replace("\u2212", "-"))
    return nums[-1] if nums else None


def _normalise(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", s)  # \frac{a}{b} -> (a)/(b)
    s = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[,;!]|\\left|\\right|\\?\$|\s", "", s).replace("\\%", "%")  # LaTeX spacing, dollars, spaces
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: "(1,2)" stays a pair
    return s.rstrip(".").lower()


def _number(s: str) -> Fraction | None:
    """A normalised string as an exact number: '3', '-0.5', '1/2', '(3)/(4)', '50%' (the same as 50), '1e-06'; else
    None."""
    m = re.fullmatch(r"\(?(-?[\d.]+(?:e[-+]?\d+)?)\)?(?:/\(?(-?[\d.]+)\)?)?%?", s)
    if m is None:
        return None
    try:
        num = Fraction(m.group(1))
        return num / Fraction(m.group(2)) if m.group(2) else num
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(a: str, b: str) -> bool:
    """Two reference answers mean the same (compared as the reward compares a response with one)."""
    return math_answer_reward(f"\\boxed{{{a}}}", b) == 1.0 or _normalise(a) == _normalise(b)


def check_one_answer(examples: list, path: str):
    """ValueError naming both lines when one prompt comes with two answers that differ (which one would be right?)."""
    first = {}
    for e in examples:
        seen = first.setdefault(e.prompt, e)
        if seen is not e and not same_answer(seen.answer, e.answer):
            raise ValueError(f"{path}:{e.line}: the same prompt as line {seen.line} with another answer "
                             f"({e.answer!r:.40} vs {seen.answer!r:.40}): expected one answer per prompt")


def math_answer_reward(response_text: str, answer) -> float:
    """1.0 if the response's final answer equals `answer` (numbers exactly, else as normalised strings), else 0.0."""
    gold = str(answer)
    if "####" in gold or "\\boxed" in gold:  # a worked solution (GSM8K, MATH): score against its final answer
        gold = extract_answer(gold) or gold
    got = extract_answer(response_text)
    if got is None:
        return 0.0
    g, a = _normalise(got), _normalise(gold)
    gn, an = _number(g), _number(a)
    if gn is not None and an is not None:
        return float(gn == an)
    return float(g == a and g != "")


def math_answer(prompt: str, response: str, answer: str) -> float:
    """The built-in reward, the default of --reward (hf_reward.py: the signature a reward of yours has)."""
    return math_answer_reward(response, answer)


# ------------------------------------------------------------------------------------------------------- the data
def load_jsonl(path: str, **kw) -> list[Example]:
    """hf_data.load_examples (jsonl or parquet; kept under its first name)."""
    return load_examples(path, **kw)


# -------------------------------------------------------------------------------------------------- the tokenizer
def _read(model_dir: str, name: str) -> dict:  # {} when the checkpoint has no such file
    p = os.path.join(model_dir, name)
    return read_json(p) if os.path.isfile(p) else {}


class HFTokenizer:
    """tokenizer.json behind task.Tokenizer's interface: encode (no special tokens), decode (ends at any EOS, drops
    special tokens), eos_ids (every id that ends a response), bos_id / eos_id (eos_ids[0]) / pad_id / mask_id (None
    without one), vocab_size (largest id + 1)."""

    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model={model_dir!r}: no tokenizer.json (only fast tokenizers are supported)")
        self.tk = _HFTokenizer.from_file(path)
        self.vocab_size = max(self.tk.get_vocab(with_added_tokens=True).values()) + 1
        files = [_read(model_dir, n) for n in ("generation_config.json", "config.json", "tokenizer_config.json")]
        self.eos_ids = self._ids("eos", files)  # generation_config first: it is what HF's generate() stops on
        if not self.eos_ids:
            raise ValueError(f"model={model_dir!r}: no EOS token in generation_config.json, config.json or "
                             "tokenizer_config.json; generation could never stop")
        self.eos_id = self.eos_ids[0]  # the pad fallback; decoding and decode() stop on any of eos_ids
        self.bos_id = (self._ids("bos", files) or [None])[0]
        self.pad_id = (self._ids("pad", files) or [self.eos_id])[0]  # no pad token: pad with EOS, as HF does
        self.mask_id = (self._ids("mask", files) or [None])[0]  # a block drafter's MASK (harness/drafters.py)
        self.add_bos = bool(files[2].get("add_bos_token", False)) and self.bos_id is not None

    def _ids(self, kind: str, files: list[dict]) -> list[int]:
        for d in files:
            v = d.get(f"{kind}_token_id")
            if v is None and d.get(f"{kind}_token") is not None:
                tok = d[f"{kind}_token"]
                tok = tok["content"] if isinstance(tok, dict) else tok  # AddedToken serialised as a dict
                v = self.tk.token_to_id(tok)
                if v is None:
                    raise ValueError(f"{kind}_token {tok!r} is not in tokenizer.json's vocabulary")
            if v is not None:
                return [int(i) for i in (v if isinstance(v, list) else [v])]
        return []

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        ends = [i for i, t in enumerate(ids) if t in self.eos_ids]
        ids = [t for t in (ids[: ends[0]] if ends else ids) if t not in (self.bos_id, self.pad_id)]
        return self.tk.decode(ids, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------------- the task
# the checkpoint's files HFTask reads (tokens, special ids, vocab size, context): in its fingerprint by their contents
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


class HFTask:
    """Prompts from `data_path` for the checkpoint in `model_dir`, split once into train / held-out eval.

    The split is a seeded shuffle of the distinct prompt texts (duplicates land on the same side, so no eval prompt is
    ever trained on); `eval_fraction` of them, at least one when > 0, are held out. Prompts longer than
    max_prompt_tokens are dropped at load time (truncating a question changes it) and counted in `dropped`.
    """

    def __init__(self, model_dir: str, data_path: str, *, eval_fraction: float = 0.1, seed: int = 0,
                 max_prompt_tokens: int = 1024, max_new_tokens: int = 256, prompt_key: str = "prompt",
                 answer_key: str = "answer", chat_template: str = "", reward: str = ""):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction}: expected 0 <= eval_fraction < 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
        self.max_new_tokens = max_new_tokens  # the response budget of every rollout (truncated responses still score)
        self.reward_spec = reward  # "" (math_answer) or --reward's module:function
        self.reward_fn = load_reward(reward) if reward else math_answer
        self.tok = HFTokenizer(model_dir)
        cfg = _read(model_dir, "config.json")
        if "vocab_size" not in cfg:
            raise ValueError(f"model={model_dir!r}: config.json is missing or has no vocab_size")
        self.model_vocab_size = int(cfg["vocab_size"])
        if self.tok.vocab_size > self.model_vocab_size:  # larger embeddings than the tokenizer are common and fine
            raise ValueError(f"model={model_dir!r}: the tokenizer has ids up to {self.tok.vocab_size - 1} but the "
                             f"model's embedding has only vocab_size={self.model_vocab_size} rows; wrong tokenizer?")
        special = self.tok.eos_ids + [self.tok.bos_id, self.tok.pad_id]
        bad = [i for i in special if i is not None and i >= self.model_vocab_size]
        if bad:
            raise ValueError(f"model={model_dir!r}: special token ids {bad} are outside the model's vocab_size="
                             f"{self.model_vocab_size}")
        self.max_prompt_tokens = max_prompt_tokens
        self.template = ChatTemplate.for_checkpoint(model_dir, chat_template)  # None: no template (or disabled)
        examples = load_examples(data_path, prompt_key=prompt_key, answer_key=answer_key, template=self.template)
        check_one_answer(examples, data_path)
        self._selection = {"data_sha256": file_sha256(data_path), "prompt_key": prompt_key, "answer_key": answer_key,
                           "eval_fraction": eval_fraction, "seed": seed, "max_prompt_tokens": max_prompt_tokens,
                           "checkpoint_files_sha256": {n: file_sha256(os.path.join(model_dir, n)) for n in
                                                       TOKENIZER_FILES}}
        lens = [len(self.encode_prompt(e)) for e in examples]
        kept = [e for e, n in zip(examples, lens) if n <= max_prompt_tokens]
        self.dropped = len(examples) - len(kept)
        if not kept:
            raise ValueError(f"data={data_path!r}: all {len(examples)} prompts exceed max_prompt_tokens="
                             f"{max_prompt_tokens}")
        ctx = int(cfg.get("max_position_embeddings", 0)) or None
        longest = max((n, e.line) for e, n in zip(examples, lens) if n <= max_prompt_tokens)
        if ctx is not None and longest[0] + max_new_tokens > ctx:
            raise ValueError(f"{data_path}:{longest[1]}: a prompt of {longest[0]} tokens + max_new_tokens="
                             f"{max_new_tokens} exceeds the model's context (max_position_embeddings={ctx}); lower "
                             "--max_prompt_tokens (longer prompts are dropped) or --max_new_tokens")
        texts = sorted({e.prompt for e in kept})
        random.Random(seed).shuffle(texts)
        n_eval = max(1, round(eval_fraction * len(texts))) if eval_fraction > 0 else 0
        if n_eval >= len(texts):
            raise ValueError(f"data={data_path!r}: {len(texts)} distinct prompts cannot leave a train split with "
                             f"eval_fraction={eval_fraction}")
        held = set(texts[:n_eval])
        self.splits = {"train": [e for e in kept if e.prompt not in held],
                       "eval": [e for e in kept if e.prompt in held]}

    def fingerprint(self) -> dict:
        """Everything that shapes the prompts (JSON data; the draft warm-up's cache key hashes it): the data file's
        contents, the row keys, the split (eval_fraction, seed), the length filter, the chat template's text, the
        tokenizer and special-token files' contents, the response budget. Not --reward: no warm-up reads a reward in
        HF mode (hf_reward.py)."""
        return {"task": "hf-math-answer", **self._selection, "max_new_tokens": self.max_new_tokens,
                "chat_template": None if self.template is None else self.template.source}

    def sample(self, k: int, rng: random.Random, split: str = "train") -> list[Example]:
        """k examples of the split; distinct within each pass over it (a new shuffled pass when k exceeds its size)."""
        if split not in self.splits:
            raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
        pool, out = self.splits[split], []
        if not pool:
            raise ValueError(f"split={split!r} is empty (eval_fraction=0?)")
        while len(out) < k:
            out += rng.sample(pool, min(k - len(out), len(pool)))
        return out

    def eval_set(self, k: int | None = None, seed: int = 1234) -> list[Example]:
        """The fixed held-out prompts every eval step uses: the whole eval split, or k of them (seeded)."""
        pool = self.splits["eval"]
        return list(pool) if k is None or k >= len(pool) else random.Random(seed).sample(pool, k)

    def encode_prompt(self, p: Example) -> torch.Tensor:  # (Tp,)
        """tokenizer.json's post-processor decides on BOS (Llama adds it, Qwen does not); add_bos_token forces it.
        A rendered chat prompt already holds its special tokens (the template wrote them): nothing is added."""
        if p.chat:
            return torch.tensor(self.tok.tk.encode(p.prompt, add_special_tokens=False).ids, dtype=torch.long)
        ids = self.tok.tk.encode(p.prompt, add_special_tokens=True).ids
        if self.tok.add_bos and ids[:1] != [self.tok.bos_id]:
            ids = [self.tok.bos_id] + ids
        return torch.tensor(ids, dtype=torch.long)

    def reward(self, p: Example, response_ids) -> float:
        """reward_fn(prompt text, decoded response, the row's answer); --reward's return value checked."""
        v = self.reward_fn(p.prompt, self.tok.decode(response_ids), p.answer)
        return reward_value(v, self.reward_spec, p.line) if self.reward_spec else v

    def score(self, problems: list[Example], responses: list) -> tuple[torch.Tensor, dict]:
        """Rewards (B,) for generated responses (each 1-D ids, maybe ending in EOS), and parts {"correct": (B,)}, the
        rewards again (with --reward: what your function returned). No format term and no EOS requirement: a
        truncated response is scored on what it wrote."""
        R = torch.tensor([self.reward(p, r) for p, r in zip(problems, responses, strict=True)])
        return R, {"correct": R.clone()}


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tasks.hf_task MODEL_DIR prompts.jsonl")
    t = HFTask(sys.argv[1], sys.argv[2])
    print(f"train {len(t.splits['train'])}, eval {len(t.splits['eval'])}, dropped {t.dropped}; vocab {t.tok.vocab_size}"
          f" <= {t.model_vocab_size}; bos {t.tok.bos_id} eos {t.tok.eos_ids} pad {t.tok.pad_id}")
    for p in t.sample(3, random.Random(0)):
        print(f"line {p.line}: {t.encode_prompt(p)[:12].tolist()}...  answer {p.answer!r}")
