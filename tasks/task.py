"""The built-in verifiable task: count up in steps of d past a limit, with a scratchpad in two valid styles.

A prompt gives a start x_0, a step d and a limit L; the answer is the first x_k = x_0 + k d with x_k > L. The response
writes the chain x_1, x_2, ..., then the answer. Each step may be written in one of two styles, both valid:

    prompt:    <bos> 3 7 + 1 7 > 1 0 0 =                (x_0 = 37, d = 17, L = 100; L always has 3 digits)
    explicit:  3 7 + 1 7 = 5 4 ;                          (x_{k-1} + d = x_k ;)
    terse:     5 4 ;                                      (x_k ;)
    answer:    # 1 0 5 <eos>

    e.g.  37+17>100=54;54+17=71;88;88+17=105;#105<eos>

The reward is verifiable:  R = 1[answer correct and the response ended with <eos>] * (1 + format_weight * f_explicit),
f_explicit = the fraction of the k steps written explicitly and correctly: a format reward (as in DeepSeek-R1) that
only counts on correct answers, so the policy can never buy format with accuracy.
SFT demonstrations (`demo_response`) write each step explicitly only with probability p_explicit, so after warm-up the
policy mostly writes terse steps. RL moves every step's style towards the explicit one (it is rewarded, and showing
the addition also makes it easier to get right), which shifts the output distribution at every step boundary of every
response -- the kind of drift under which a frozen speculative draft goes stale. Every input a step needs is local
(the previous value, d in the prompt), so a ~1M-parameter policy learns it in a few minutes of CPU SFT.

Prompts come from a seeded generator. Problems are split deterministically into train and held-out eval by a hash,
so no eval prompt is ever trained on.

    python -m tasks.task        # prints a few prompts, demonstrations and their rewards

Letters: B batch rows, T tokens.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

# ------------------------------------------------------------------------------------------------------- tokenizer
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB = (PAD, BOS, EOS) + tuple("0123456789+=;#>")


class Tokenizer:
    """Character-level tokenizer over VOCAB; the special tokens are single ids."""

    def __init__(self, vocab=VOCAB):
        self.vocab = tuple(vocab)
        self.id = {s: i for i, s in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = self.id[PAD], self.id[BOS], self.id[EOS]
        self.eos_ids = [self.eos_id]  # every id that ends a response (tasks/protocol.py): here the one <eos>

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.id})
        if bad:
            raise ValueError(f"encode: characters {bad} are not in the vocabulary {''.join(self.vocab[3:])}")
        return [self.id[c] for c in text]

    def decode(self, ids) -> str:
        """ids -> text; the text ends before the first id in eos_ids, <bos>/<pad> are dropped."""
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i in self.eos_ids:
                break
            if i not in (self.bos_id, self.pad_id):
                out.append(self.vocab[i])
        return "".join(out)


# ------------------------------------------------------------------------------------------------------------ task
@dataclass(frozen=True)
class Problem:
    x0: int  # start
    d: int  # step
    limit: int  # L

    @property
    def chain(self) -> list[int]:  # x_1 .. x_k, the last one the first value > L
        xs, x = [], self.x0
        while x <= self.limit:
            x += self.d
            xs.append(x)
        return xs

    @property
    def answer(self) -> int:
        return self.chain[-1]

    @property
    def n_steps(self) -> int:
        return len(self.chain)

    @property
    def prompt(self) -> str:
        return f"{self.x0}+{self.d}>{self.limit:03d}="


_STEP = re.compile(r"(?:(\d+)\+(\d+)=)?(\d+);")  # one step: optional "x_{k-1}+d=", then "x_k;"


def demo_response(p: Problem, p_explicit: float, rng: random.Random) -> str:
    """An SFT demonstration: the correct chain, each step explicit with probability p_explicit, then the answer."""
    steps, prev = [], p.x0
    for x in p.chain:
        explicit = f"{prev}+{p.d}=" if rng.random() < p_explicit else ""
        steps.append(f"{explicit}{x};")
        prev = x
    return "".join(steps) + f"#{p.answer}"


def parse_response(text: str) -> tuple[list, str | None]:
    """text (decoded, without <eos>) -> (steps as regex matches, answer string or None if no '#')."""
    head, sep, answer = text.partition("#")
    steps, pos = [], 0
    while pos < len(head):
        m = _STEP.match(head, pos)
        if m is None:
            break
        steps.append(m)
        pos = m.end()
    return steps, (answer if sep else None)


def reward(p: Problem, text: str, ended: bool, format_weight: float) -> tuple[float, dict]:
    """R = 1[correct answer and ended with <eos>] * (1 + format_weight * fraction of the k steps written explicitly).

    Returns (R, parts) with parts = {"correct": 0/1, "explicit": fraction}. A response that does not end (hit the
    token limit) gets no correctness credit. An explicit step only counts if it is the right step k, so the format
    term cannot be farmed with well-formed garbage or extra steps.
    """
    steps, answer = parse_response(text)
    correct = float(ended and answer is not None and answer == str(p.answer))
    chain = [p.x0] + p.chain
    good = sum(1 for k, m in enumerate(steps[: p.n_steps])
               if m.group(1) is not None
               and (m.group(1), m.group(2), m.group(3)) == tuple(map(str, (chain[k], p.d, chain[k + 1]))))
    explicit = good / p.n_steps
    return correct * (1.0 + format_weight * explicit), {"correct": correct, "explicit": explicit}


class ProblemSource:
    """Seeded generator of count-up problems with min_steps..max_steps steps and a deterministic held-out split.

    x_0 in [10, 99], d in [3, 19], k uniform in [min_steps, max_steps], then L uniform in [x_{k-1}, x_k - 1] (so the
    answer is x_k). A problem belongs to the eval split iff hash(x_0, d, L) % eval_mod == 0 (a fixed integer hash, not
    Python's salted one), so train and eval never overlap, whatever the seeds.
    """

    def __init__(self, min_steps: int = 4, max_steps: int = 7, eval_mod: int = 10):
        if not (1 <= min_steps <= max_steps <= 18):
            raise ValueError(f"steps: expected 1 <= min_steps={min_steps} <= max_steps={max_steps} <= 18")
        if eval_mod < 2:
            raise ValueError(f"eval_mod={eval_mod}: expected >= 2")
        self.min_steps, self.max_steps, self.eval_mod = min_steps, max_steps, eval_mod

    def fingerprint(self) -> dict:
        """Everything that shapes the problems and their train / eval split (with the sampler's seed)."""
        return {"min_steps": self.min_steps, "max_steps": self.max_steps, "eval_mod": self.eval_mod}

    def is_eval(self, p: Problem) -> bool:
        h = (p.x0 * 1_000_003 + p.d * 998_244_353 + p.limit * 19_260_817) % 2_147_483_647
        return h % self.eval_mod == 0

    def _draw(self, rng: random.Random) -> Problem:
        x0, d, k = rng.randint(10, 99), rng.randint(3, 19), rng.randint(self.min_steps, self.max_steps)
        return Problem(x0, d, rng.randint(x0 + (k - 1) * d, x0 + k * d - 1))

    def sample(self, k: int, rng: random.Random, split: str = "train") -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
        out = []
        while len(out) < k:
            p = self._draw(rng)
            if self.is_eval(p) == (split == "eval"):
                out.append(p)
        return out

    def eval_set(self, k: int, seed: int = 1234) -> list[Problem]:
        """The fixed held-out prompts every eval step uses."""
        return self.sample(k, random.Random(seed), "eval")


# ------------------------------------------------------------------------------------------------- tensors for models
def encode_prompt(tok: Tokenizer, p: Problem) -> torch.Tensor:  # (Tp,) <bos> x0 + d > L =
    return torch.tensor([tok.bos_id] + tok.encode(p.prompt), dtype=torch.long)


def encode_demo(tok: Tokenizer, p: Problem, p_explicit: float, rng: random.Random) -> tuple[torch.Tensor, int]:
    """(tokens (T,) = prompt + demo response + <eos>, prompt length)."""
    prompt = encode_prompt(tok, p)
    resp = torch.tensor(tok.encode(demo_response(p, p_explicit, rng)) + [tok.eos_id], dtype=torch.long)
    return torch.cat([prompt, resp]), prompt.numel()


def max_response_tokens(max_steps: int) -> int:
    """Longest well-formed response: max_steps explicit steps of <= 11 tokens ("xxx+dd=yyy;"), '#', 3 digits, <eos>
    (x_0 <= 99, d <= 19: values stay below 1000 for max_steps <= 18)."""
    return 11 * max_steps + 1 + 3 + 1


def score(tok: Tokenizer, problems: list[Problem], responses: list[torch.Tensor], format_weight: float):
    """Rewards (B,) and their parts for generated responses (each a 1-D token tensor, maybe ending in <eos>)."""
    R, correct, explicit = [], [], []
    for p, r in zip(problems, responses):
        ids = r.tolist()
        ended = any(i in tok.eos_ids for i in ids)
        rew, parts = reward(p, tok.decode(ids), ended, format_weight)
        R.append(rew)
        correct.append(parts["correct"])
        explicit.append(parts["explicit"])
    return torch.tensor(R), {"correct": torch.tensor(correct), "explicit": torch.tensor(explicit)}


class CountUpTask:
    """The built-in task behind the interface the experiment uses (tasks/protocol.py; hf_task.HFTask has it too):
    tok (eos_ids, encode/decode), sample(k, rng, split), eval_set(k, seed), encode_prompt(p) -> (Tp,) ids,
    score(problems, responses) -> (R (B,), {"correct": (B,), "explicit": (B,)}), max_new_tokens, fingerprint(), and
    the SFT demonstrations encode_demo(p, rng), each step explicit with probability p_explicit."""

    def __init__(self, min_steps: int = 4, max_steps: int = 7, format_weight: float = 0.5, p_explicit: float = 0.7):
        self.tok, self.source, self.format_weight = Tokenizer(), ProblemSource(min_steps, max_steps), format_weight
        self.max_new_tokens = max_response_tokens(max_steps)
        self.p_explicit = p_explicit

    def fingerprint(self) -> dict:
        """Everything that shapes the prompts, demonstrations and rewards (JSON data; the warm-ups' cache keys hash
        it): the vocabulary, the problem source, the reward's format weight, the response budget, the demonstrations'
        p_explicit."""
        return {"task": "count-up", "vocab": list(self.tok.vocab), "source": self.source.fingerprint(),
                "format_weight": self.format_weight, "max_new_tokens": self.max_new_tokens,
                "p_explicit": self.p_explicit}

    def sample(self, k: int, rng: random.Random, split: str = "train") -> list[Problem]:
        return self.source.sample(k, rng, split)

    def eval_set(self, k: int, seed: int = 1234) -> list[Problem]:
        return self.source.eval_set(k, seed)

    def encode_prompt(self, p: Problem) -> torch.Tensor:
        return encode_prompt(self.tok, p)

    def score(self, problems: list[Problem], responses: list[torch.Tensor]):
        return score(self.tok, problems, responses, self.format_weight)

    def encode_demo(self, p: Problem, rng: random.Random) -> tuple[torch.Tensor, int]:
        return encode_demo(self.tok, p, self.p_explicit, rng)


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    tok, src, rng = Tokenizer(), ProblemSource(), random.Random(0)
    print(f"vocab ({tok.vocab_size}): {' '.join(tok.vocab)}")
    for p in src.sample(3, rng) + src.eval_set(2):
        for pe in (0.0, 1.0):
            text = demo_response(p, pe, rng)
            R, parts = reward(p, text, True, 0.5)
            print(f"{'eval ' if src.is_eval(p) else 'train'} {p.prompt}{text}  ({len(text) + 1} tokens)  R={R:.2f}")
