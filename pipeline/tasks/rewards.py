"""The built-in rewards: a response text and a reference answer -> (score, info).

A `Reward` is any callable with a `name` and the `bounds` its scores lie in (the run refuses a
score that is not finite or out of bounds, naming the row: pipeline.tasks.reward_scoring). Two
are built in; `task.reward` names them, or a plug-in (pipeline.tasks.reward_plugins):

- `ExactAnswerReward`: the response's final answer (the last `\\boxed{}`'s content, else the last
  `#### N` line, the arithmetic tasks' format) compared with the gold answer as a string.
- `MathVerifyReward`: math-verify (Hugging Face) extracts the response's final answer (a
  `\\boxed{}` first, else the last LaTeX or plain expression) and compares it with the gold answer
  numerically and symbolically with sympy: `\\boxed{14/2}`, `7.0` and `7` all match a gold `7`.
  Gold answers are parsed once per distinct answer and cached. An optional format bonus
  `format_weight` rewards a response that puts its answer in `\\boxed{}`.

math-verify bounds every parse and comparison by a `signal.alarm` timeout, and `signal` works
only in the main thread: elsewhere math-verify raises instead of scoring. `MathVerifyReward`
therefore passes its timeout in the main thread and none in other threads (the caller then owns
the time limit). The run's reward workers are processes (pipeline.tasks.reward_pool) that call it
in their main thread, so there it has both its own timeouts and the pool's deadline.

math-verify is imported on first use, so importing the task registry stays cheap.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from typing import Any, Protocol

from pipeline.tasks import arith

_BOXED = re.compile(r"\\boxed\s*\{")


class Reward(Protocol):
    name: str
    bounds: tuple[float, float]  # every score lies in [low, high]

    def __call__(self, response: str, answer: str) -> tuple[float, dict[str, Any]]: ...


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces matched), or None if there is none
    (or it is never closed)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


class ExactAnswerReward:
    """1.0 when the response's final answer is exactly the gold answer (both stripped of
    surrounding whitespace): the last `\\boxed{}`'s content, else the last `#### N` line."""

    name = "exact"
    bounds = (0.0, 1.0)

    def __call__(self, response: str, answer: str) -> tuple[float, dict[str, Any]]:
        boxed = last_boxed(response)
        found = boxed if boxed is not None else arith.extract_answer(response)
        correct = found is not None and found.strip() == answer.strip()
        return float(correct), {"extracted": found}


def _signal_timeout(seconds: int) -> int | None:
    """`seconds` where math-verify's signal-based timeout can work (the main thread), else None."""
    return seconds if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=1 << 16)
def _parse_gold(answer: str, timeout: int | None) -> tuple:
    from math_verify import parse
    from sympy import Basic, MatrixBase

    def readable(found: list) -> bool:  # parse() also returns the raw text it matched: not a value
        return any(isinstance(x, (Basic, MatrixBase)) for x in found)

    found = parse(answer, parsing_timeout=timeout)
    if not readable(found):  # a bare "\frac{1}{2}" is found only inside math delimiters
        found = parse(f"${answer}$", parsing_timeout=timeout)
    return tuple(found) if readable(found) else ()


def parse_gold(answer: str, timeout_s: int = 5) -> tuple:
    """The parsed gold answer, () when math-verify finds no value in it; cached per answer."""
    return _parse_gold(answer, _signal_timeout(timeout_s))


class MathVerifyReward:
    """1.0 for a final answer equal to the gold answer (math-verify), + `format_weight` if boxed."""

    name = "math_verify"

    def __init__(self, *, format_weight: float = 0.0, timeout_s: int = 5) -> None:
        if format_weight < 0 or not math.isfinite(format_weight):
            raise ValueError(f"format_weight must be a finite number >= 0, got {format_weight}")
        if timeout_s < 1:
            raise ValueError(f"timeout_s must be >= 1 second, got {timeout_s}")
        self.format_weight = format_weight
        self.timeout_s = timeout_s
        self.bounds = (0.0, 1.0 + format_weight)

    def __call__(self, response: str, answer: str) -> tuple[float, dict[str, Any]]:
        from math_verify import parse, verify

        gold = parse_gold(answer, self.timeout_s)
        if not gold:
            raise ValueError(f"math-verify cannot parse the gold answer {answer!r}; check the task's answer field")
        timeout = _signal_timeout(self.timeout_s)
        pred = parse(response, parsing_timeout=timeout)
        correct = bool(pred) and verify(list(gold), pred, timeout_seconds=timeout)
        boxed = _BOXED.search(response) is not None
        score = float(correct) + (self.format_weight if boxed else 0.0)
        return score, {"correct": correct, "boxed": boxed, "extracted": str(pred[-1]) if pred else None}
