"""Multiply-add worked by repeated addition: problems, worked solutions, careless teacher, reward.

A *problem* is `c+a*b` (c in 0..99, a digit a in 2..9, a count b >= 1) with its value as the
*answer*. The reference *response* starts from c and adds a, b times, one *step* per line:
`r;t+a=s` with r the additions still to do after this one (a countdown from b - 1 to 0), t the
running total and s = t + a. The last line holds the answer after `#### `:

    prompt    35+7*4\n
    response  3;35+7=42
              2;42+7=49
              1;49+7=56
              0;56+7=63
              #### 63

Every token depends on a few nearby ones, on purpose: the countdown and the total on the line
above, the addend a (on the line above, or right before the prompt's only `*`), a one-digit
addition with its carry; the countdown's 0 says the last step has come. Nothing asks for the
i-th digit of an operand (column addition) or a copy of a long line (an expression rewritten
step by step), which a tiny model learns far more slowly. The response length is linear in b,
drawn long-tailed: P(b) ~ b^-tail for b in 1..max_count. With the defaults (64, 1.3), in draws
of 32 problems the median response is ~38 tokens and the longest typically 15-18 times that
(~630 tokens); none exceeds 830 tokens (prompt included: a context of 1024 holds every problem).

The *careless* teacher works every step right but the last, whose carry it drops (`0;56+7=53`,
`#### 53`): its answer is wrong exactly when the last addition carries, on about half the
problems. Pretraining on a mixture of both teachers leaves a policy that writes the carry in part
of its samples, something an exact-answer reward can select.

A *checking* demonstration (`checked_solution`) works the problem (carelessly or not), writes its
answer, then works it again, always carefully, and answers again; the reward reads the last
answer, so a check repairs a careless first pass:

    3;35+7=42            <- first pass (here careless: 53)
    ...
    0;56+7=53
    #### 53
    3;35+7=42            <- the check
    ...
    0;56+7=63
    #### 63

A policy pretrained with a share of checking demonstrations chooses at each first answer whether
to stop or check, so the samples of one prompt differ in length by up to 2x, as the samples of a
reasoning model do, and checking earns reward, so RL can learn to check more (responses grow).

Splits and streams as in `pipeline.tasks.arith`: a prompt's split is a stable hash of its text,
and problem i of a split is drawn from a `random.Random` keyed by (seed, split, i). This module
knows nothing about tokens or models.
"""

from __future__ import annotations

import random
import re

from pipeline.tasks.arith import ANSWER_PREFIX, SPLITS, Problem, extract_answer, split_of

MAX_COUNT = 64
TAIL = 1.3
_PROMPT_RE = re.compile(r"(\d+)\+(\d)\*(\d+)\n?")


def operands(prompt: str) -> tuple[int, int, int]:
    """`35+7*4\n` -> (35, 7, 4)."""
    found = _PROMPT_RE.fullmatch(prompt)
    if found is None:
        raise ValueError(f"not a c+a*b prompt: {prompt!r}")
    c, a, b = map(int, found.groups())
    return c, a, b


def drop_carry(t: int, a: int) -> int:
    """t + a with the carry out of the units dropped (56 + 7 -> 53; 59 + 1 -> 50)."""
    return t - t % 10 + (t % 10 + a) % 10


def worked_solution(c: int, a: int, b: int, *, careless: bool = False) -> str:
    """One `r;t+a=s` line per addition, then `#### value`; `careless`: the last one drops its carry."""
    if b < 1:
        raise ValueError(f"the count b must be >= 1, got {b}")
    lines, total = [], c
    for left in range(b - 1, -1, -1):
        s = drop_carry(total, a) if careless and left == 0 else total + a
        lines.append(f"{left};{total}+{a}={s}")
        total = s
    return "\n".join(lines + [ANSWER_PREFIX + str(total)])


def checked_solution(prompt: str, *, careless: bool) -> str:
    """A first pass (`careless`: its last addition drops the carry) and its answer, then a careful
    second pass and its answer: twice the lines of `worked_solution`."""
    c, a, b = operands(prompt)
    return worked_solution(c, a, b, careless=careless) + "\n" + worked_solution(c, a, b)


def careless_solution(prompt: str) -> str:
    """The careless teacher's response: right up to the last addition, which drops its carry."""
    return worked_solution(*operands(prompt), careless=True)


def _draw_count(rng: random.Random, max_count: int, tail: float) -> int:
    counts = range(1, max_count + 1)
    return rng.choices(counts, weights=[b**-tail for b in counts])[0]


def make_problem(split: str, index: int, seed: int, *, max_count: int = MAX_COUNT, tail: float = TAIL) -> Problem:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"mult:{seed}:{split}:{index}")
    b = _draw_count(rng, max_count, tail)  # outside the loop: both splits keep P(b)
    while True:  # rejection keeps only prompts of this split; 1.1 draws on average for train
        c, a = rng.randrange(100), rng.randrange(2, 10)
        prompt = f"{c}+{a}*{b}\n"
        if split_of(prompt) == split:
            return Problem(id=f"mult-{split}-{index:06d}", prompt=prompt, answer=str(c + a * b),
                           response=worked_solution(c, a, b))


def make_problems(split: str, num: int, seed: int, *, start: int = 0, max_count: int = MAX_COUNT,
                  tail: float = TAIL) -> list[Problem]:
    """Problems start..start+num-1 of a split's stream."""
    if num < 0 or start < 0:
        raise ValueError(f"num and start must be >= 0, got num={num}, start={start}")
    if not 1 <= max_count <= 999:
        raise ValueError(f"max_count must be in 1..999, got {max_count}")
    if tail < 0:
        raise ValueError(f"tail must be >= 0, got {tail}")
    return [make_problem(split, i, seed, max_count=max_count, tail=tail) for i in range(start, start + num)]


def reward(text: str, answer: str) -> float:
    """1.0 if the response's last `#### N` line is exactly `answer`, else 0.0."""
    return 1.0 if extract_answer(text) == answer else 0.0
