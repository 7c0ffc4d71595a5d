"""Synthetic multi-digit addition with worked steps: problems, reference solutions, reward.

A *problem* is `a+b` with its final *answer*. The reference *response* adds column by column
from the units, one *step* per line: `x+y+c=s` with the digits x of a and y of b in that column
(0 once an operand has no more digits), the carry c from the previous column, and their sum s.
The last line holds the answer after `#### `, read off the steps' last digits in reverse:

    prompt    4728+395\n
    response  8+5+0=13
              2+9+1=12
              7+3+1=11
              4+0+1=5
              #### 5123

The number of steps is the *digits* of the longer operand. Difficulty is long-tailed: digits d
in 1..max_digits is drawn with P(d) ~ d^-tail, so with the defaults about half the problems
have one digit, three in four at most three, and a few percent 10 or more (responses 5-8x the
median length).

Splits: each prompt belongs to exactly one split, by a stable hash of its text (1 in 10 prompts
is "test"), so training never sees a test prompt. Problem i of a split is drawn from its own
`random.Random` keyed by (seed, split, i): streams are deterministic, and a prefix of a longer
draw equals a shorter draw.

This module knows nothing about tokens or models.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "test")
TEST_EVERY = 10  # one prompt in TEST_EVERY belongs to the test split
ANSWER_PREFIX = "#### "
_ANSWER_RE = re.compile(r"####[ \t]*(\d+)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    answer: str
    response: str  # reference worked solution, without end-of-sequence marker
    # The source row's other fields (a data file's columns beyond prompt, answer and id), passed to a
    # plug-in reward; empty for the generated tasks. Not part of equality or hashing.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # The conversation a chat run renders with the tokenizer's chat template, as (role, content)
    # turns ending with the user's (pipeline.data.chat); empty: the prompt is plain text.
    messages: tuple[tuple[str, str], ...] = ()


def split_of(prompt: str) -> str:
    return "test" if zlib.crc32(prompt.encode()) % TEST_EVERY == 0 else "train"


def worked_solution(a: int, b: int) -> str:
    """The reference response for `a+b`: one `x+y+c=s` line per column, then the answer line."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]  # units first
    carry, lines = 0, []
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    lines.append(ANSWER_PREFIX + str(a + b))
    return "\n".join(lines)


def careless_solution(a: int, b: int) -> str:
    """`a+b` worked as a careless demonstrator does: every column right, but the carry out of the
    last column is never written down (65+58: `5+8+0=13`, `6+5+1=12`, `#### 23`, not 123).

    A classic slip of column addition. Only problems whose last column carries (its sum >= 10)
    differ from `worked_solution`; their answer is wrong.
    """
    lines = worked_solution(a, b).splitlines()
    answer = str(a + b)
    if int(lines[-2].rpartition("=")[2]) >= 10:
        answer = answer[1:]
    return "\n".join(lines[:-1] + [ANSWER_PREFIX + answer])


def operands(prompt: str) -> tuple[int, int]:
    """`a+b\n` -> (a, b)."""
    a, _, b = prompt.strip().partition("+")
    return int(a), int(b)


def _number(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randrange(10)
    return rng.randrange(10 ** (digits - 1), 10**digits)


def _draw_digits(rng: random.Random, max_digits: int, tail: float) -> int:
    weights = [d**-tail for d in range(1, max_digits + 1)]
    return rng.choices(range(1, max_digits + 1), weights=weights)[0]


def make_problem(split: str, index: int, seed: int, *, max_digits: int = 12, tail: float = 1.5) -> Problem:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"arith:{seed}:{split}:{index}")
    digits = _draw_digits(rng, max_digits, tail)  # outside the loop: both splits keep P(d)
    while True:  # rejection keeps only prompts of this split; 1.1 draws on average for train
        a, b = _number(rng, digits), _number(rng, rng.randint(1, digits))
        if rng.random() < 0.5:
            a, b = b, a
        prompt = f"{a}+{b}\n"
        if split_of(prompt) == split:
            return Problem(id=f"arith-{split}-{index:06d}", prompt=prompt, answer=str(a + b), response=worked_solution(a, b))


def make_problems(split: str, num: int, seed: int, *, start: int = 0, max_digits: int = 12, tail: float = 1.5) -> list[Problem]:
    """Problems start..start+num-1 of a split's stream."""
    if num < 0 or start < 0:
        raise ValueError(f"num and start must be >= 0, got num={num}, start={start}")
    if not 1 <= max_digits <= 18:
        raise ValueError(f"max_digits must be in 1..18, got {max_digits}")
    if tail < 0:
        raise ValueError(f"tail must be >= 0, got {tail}")
    return [make_problem(split, i, seed, max_digits=max_digits, tail=tail) for i in range(start, start + num)]


def extract_answer(text: str) -> str | None:
    """The number on the last `#### N` line of a response, or None if there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def reward(text: str, answer: str) -> float:
    """1.0 if the response's final answer equals `answer` exactly, else 0.0."""
    return 1.0 if extract_answer(text) == answer else 0.0
