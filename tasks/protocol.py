"""What the harness needs of a task, in one place, and the registry behind --task.

A task is any object with these members (typing.Protocol: no base class to inherit):

    tok                 .vocab_size (the policy's vocabulary), .eos_ids (every id that ends a response: generation
                        stops at the first of any of them), .encode / .decode
    max_new_tokens      the response budget of every rollout (--max_new_tokens > 0 overrides it)
    sample(k, rng, split="train") -> list       k problems of the "train" or the held-out "eval" split
    eval_set(k, seed=1234) -> list              the fixed held-out problems every eval step uses
    encode_prompt(p) -> (Tp,) LongTensor        what the policy is prompted with
    score(problems, responses) -> (R (B,), parts)   rewards of generated responses (1-D ids, maybe ending in an
                                                    id of eos_ids); parts["correct"] (B,) always,
                                                    parts["explicit"] (B,) optionally (the built-in task's format
                                                    term; 0 in the logs else)
    fingerprint() -> dict                       every setting that shapes its prompts, demonstrations and rewards
                                                (JSON-serialisable): the warm-ups' cache keys read it

and, for the SFT warm-up of the policy, a Demonstrations task also has

    encode_demo(p, rng) -> (tokens (T,), n_prompt)   prompt + demonstration response + eos ids, prompt length

A task without encode_demo gets no SFT: the policy starts from its seeded random initialisation.

    TASKS               --task NAME -> factory(cfg) -> task: the registered names (the default: "countup")
    make_task(name, cfg)    a registered name, or "module:factory" (any importable module; factory(cfg) -> task)

HF mode (--model=DIR --data=FILE) builds hf_task.HFTask instead, as selected by --model (harness/experiment.py).
"""
from __future__ import annotations

import importlib
import random
from typing import Callable, Protocol, runtime_checkable

import torch


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: list[int]  # every id that ends a response (an HF checkpoint's generation config may list several)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


@runtime_checkable
class Task(Protocol):
    tok: Tokenizer
    max_new_tokens: int

    def sample(self, k: int, rng: random.Random, split: str = "train") -> list: ...

    def eval_set(self, k: int, seed: int = 1234) -> list: ...

    def encode_prompt(self, p) -> torch.Tensor: ...

    def score(self, problems: list, responses: list) -> tuple[torch.Tensor, dict]: ...

    def fingerprint(self) -> dict: ...


@runtime_checkable
class Demonstrations(Protocol):
    def encode_demo(self, p, rng: random.Random) -> tuple[torch.Tensor, int]: ...


def _countup(cfg):
    from tasks.task import CountUpTask
    return CountUpTask(cfg.min_steps, cfg.max_steps, cfg.format_weight, p_explicit=cfg.p_explicit)


TASKS: dict[str, Callable] = {  # --task NAME -> factory(cfg) -> task
    "countup": _countup,  # the built-in count-up task (tasks/task.py)
}


REQUIRED = ("tok", "max_new_tokens", "sample", "eval_set", "encode_prompt", "score", "fingerprint")  # make_task checks


def factory(name: str) -> Callable:
    """The factory of a registered name or of "module:factory"; ValueError naming --task otherwise."""
    if name in TASKS:
        return TASKS[name]
    mod, sep, attr = name.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"--task={name}: expected one of {', '.join(TASKS)}, or module:factory")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--task={name}: expected an importable module:factory ({e})") from None
    if not callable(fn):
        raise ValueError(f"--task={name}: {attr} is not callable (expected factory(cfg) -> task)")
    return fn


def make_task(name: str, cfg) -> Task:
    """The task `name` builds from the run's config, checked against the protocol."""
    tsk = factory(name)(cfg)
    missing = [m for m in REQUIRED if not hasattr(tsk, m)]
    if missing:
        raise ValueError(f"--task={name}: the task lacks {', '.join(missing)} (tasks/protocol.py lists the members)")
    if not isinstance(getattr(tsk.tok, "eos_ids", None), (list, tuple)):
        raise ValueError(f"--task={name}: expected tok.eos_ids, a list of the ids that end a response "
                         "(tasks/protocol.py)")
    return tsk


def task_from_config(cfg):
    """The run's task (cfg: harness.config.Config, read only): the one --task names (default the built-in count-up
    task), or in HF mode the prompts file with the checkpoint's tokenizer (hf_task.py). train.py's build and
    `python -m harness.warmup` both call this: the same task, so the same cache keys."""
    if cfg.hf_mode:
        from tasks.hf_task import HFTask
        return HFTask(cfg.model, cfg.data, eval_fraction=cfg.eval_fraction, seed=cfg.seed,
                      max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens or 256,
                      prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, chat_template=cfg.chat_template,
                      reward=cfg.reward)
    tsk = make_task(cfg.task, cfg)
    tsk.max_new_tokens = cfg.max_new_tokens or tsk.max_new_tokens
    return tsk
