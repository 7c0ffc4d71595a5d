"""Synthetic multi-digit addition with worked steps: problems, reference solutions, reward.

A *problem* is `a+b` with its final *answer*. The reference *response* works right to left, one
*step* per line. Each line is the state after the step: what is left of each operand once its
last digit is consumed, the carry `c`, and the result digits found so far `r`. An exhausted
operand counts as 0. The last line holds the answer after `#### `:

    prompt    4728+395\\n
    response  472+39 c1 r3
              47+3 c1 r23
              4+ c1 r123
              + c0 r5123
              #### 5123

Every step is local (drop a last digit, add three digits, prepend one), so a tiny model can
learn it; the number of steps is the *digits* of the longer operand, and a line repeats what is
left of the operands, so response length grows about quadratically with digits.

Difficulty is long-tailed: digits d in 1..max_digits is drawn with P(d) ~ d^-tail, so about
half the problems have one digit and a few percent need 10 or more (responses 10-20x longer).

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
from dataclasses import dataclass

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


def split_of(prompt: str) -> str:
    return "test" if zlib.crc32(prompt.encode()) % TEST_EVERY == 0 else "train"


def worked_solution(a: int, b: int) -> str:
    """The reference response for `a+b`: one state line per digit, then the answer line."""
    rest_a, rest_b, carry, result = str(a), str(b), 0, ""
    lines = []
    while rest_a or rest_b:
        total = int(rest_a[-1:] or 0) + int(rest_b[-1:] or 0) + carry
        rest_a, rest_b = rest_a[:-1], rest_b[:-1]
        carry, result = total // 10, str(total % 10) + result
        lines.append(f"{rest_a}+{rest_b} c{carry} r{result}")
    answer = str(a + b)
    assert answer == ("1" if carry else "") + result
    lines.append(ANSWER_PREFIX + answer)
    return "\n".join(lines)


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
    while True:  # rejection keeps only prompts of this split; 1.1 draws on average for train
        digits = _draw_digits(rng, max_digits, tail)
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
