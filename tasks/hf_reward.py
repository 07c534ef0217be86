"""--reward module:function: HF mode's reward from a function of yours instead of the built-in math-answer rule.

    def my_reward(prompt: str, response: str, answer: str) -> float

    prompt    the text the checkpoint's tokenizer encoded (a chat prompt as its template rendered it)
    response  the decoded response: up to its first EOS id, special tokens dropped; a truncated one as it stands
    answer    the row's --answer_key field as a string (a number in the data arrives as str(number))
    returns   the reward R_i of GRPO's group advantage: a finite real number (True / False count as 1 / 0)

The built-in rule has this shape (hf_task.math_answer, the default when --reward is ''). The module is imported from
PYTHONPATH, then from the working directory (added to the end of sys.path when it is not on it). Every problem is one
line naming --reward, at config time: not module:function, the module not found or failing to import, no such
function, not callable, a signature that cannot take (prompt, response, answer); at scoring time (reward_value): a
return value that is not a finite number, naming its type and the data line. Outside HF mode the flag is refused:
the built-in task (tasks/task.py) has its own reward.

    fn = load_reward("my_rewards:exact_match")       # the function, checked; ValueError naming --reward otherwise
    r = reward_value(fn(prompt, response, answer), "my_rewards:exact_match", line)   # float

No warm-up reads a reward in HF mode (no SFT; the draft's warm-up samples the train prompts and fits the policy's
distributions), so the function is not part of any cache key; a resume compares --reward like any other flag.
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys

SIGNATURE = "(prompt, response, answer) -> float"


def _import(spec: str, mod: str):
    """The module `mod` from PYTHONPATH, else the working directory; ValueError naming --reward otherwise."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # "" is the working directory for python -c / -m
        sys.path.append(cwd)
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod == e.name or mod.startswith(e.name + ".")):
            raise ValueError(f"--reward={spec}: no module {mod!r} on PYTHONPATH or in the working directory "
                             f"({cwd}); expected an importable module:function") from None
        raise ValueError(f"--reward={spec}: importing module {mod!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 -- the user's module: any error on import is named in one line
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"--reward={spec}: importing module {mod!r} raised {type(e).__name__}: {first}") from None


def load_reward(spec: str):
    """The function `spec` = "module:function" names, checked up front against f(prompt, response, answer)."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr.isidentifier():
        raise ValueError(f"--reward={spec}: expected module:function, e.g. --reward=my_rewards:exact_match")
    fn = getattr(_import(spec, mod), attr, None)
    if fn is None:
        raise ValueError(f"--reward={spec}: module {mod!r} has no function {attr!r}")
    if not callable(fn):
        raise ValueError(f"--reward={spec}: {mod}.{attr} is not callable (its type: {type(fn).__name__}); expected "
                         f"a function {attr}{SIGNATURE}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its first call shows
        return fn
    try:
        sig.bind("prompt", "response", "answer")
    except TypeError as e:
        raise ValueError(f"--reward={spec}: {attr}{sig} cannot be called as {attr}(prompt, response, answer) ({e}); "
                         f"expected {attr}{SIGNATURE}") from None
    return fn


def reward_value(v, spec: str, line: int) -> float:
    """The reward function's return value as a float; ValueError naming --reward, its type and the data line if it
    is not a finite real number."""
    if isinstance(v, numbers.Real) and math.isfinite(v):
        return float(v)
    what = f"{v!r:.40} (not finite)" if isinstance(v, numbers.Real) else f"{v!r:.40}, of type {type(v).__name__},"
    raise ValueError(f"--reward={spec} returned {what} for the data's line {line}: expected a finite number")


def _reward_ok(v: str, c) -> bool:
    """--reward's config check: '' anywhere; module:function in HF mode only (load_reward's errors name the flag)."""
    return v == "" or (c.hf_mode and load_reward(v) is not None)


REWARD_ROW = (_reward_ok, "'' outside HF mode: the built-in task has its own reward (tasks/task.py); a "
                          f"module:function, function{SIGNATURE}, needs --model=<HF checkpoint dir> --data=FILE "
                          "(tasks/hf_reward.py)")
