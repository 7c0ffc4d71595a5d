"""Small arithmetic word problems with numeric answers, and the shipped math files.

`python -m pipeline.tasks.make_math [--train 2000] [--test 200] [--seed 0] [--out-dir DIR]` writes
`math_train.jsonl` and `math_test.jsonl` (default: pipeline/tasks/data/), one problem per line:
`{"id", "prompt", "answer", "solution"}`. The shipped files are this command's output with the
defaults; a test regenerates them and compares.

A problem is one or two steps of addition, subtraction or multiplication with small numbers
(operands up to 20, products up to 81; a count of things someone has is at least 2, so
every noun is plural), as a short story: "Tom has 3 apples. Tom buys 4 more.
How many apples does Tom have now?". Its *solution* writes each step as `a + b = c.` and ends
with `The answer is \\boxed{N}.`, the format the math reward's instruction asks for. Answers are
non-negative integers.

Splits and streams work as in `pipeline.tasks.arith`: a prompt belongs to the split its text
hashes to (so no test prompt is ever a train prompt), and problem i of a split comes from
`random.Random` keyed by (seed, split, i), so a prefix of a longer draw equals a shorter draw.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from common.atomic import atomic_file
from pipeline.tasks.arith import SPLITS, Problem, split_of

DATA_DIR = Path(__file__).resolve().parent / "data"
NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe", "Leo", "Emma", "Noah", "Ava", "Omar", "Yuki",
         "Ravi", "Sara")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "balloons", "shells", "coins",
          "stamps", "toy cars", "oranges", "crayons")
HOLDERS = ("bags", "boxes", "packs", "jars", "baskets", "rows")

# A template draws its numbers and returns (story, steps as (a, op, b), answer).
Story = tuple[str, list[tuple[int, str, int]], int]


def _add(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a, b = r.randint(2, 20), r.randint(2, 20)
    text = r.choice((f"{n} has {a} {x}. {n} buys {b} more. How many {x} does {n} have now?",
                     f"{n} has {a} {x} and {m} has {b} {x}. How many {x} do they have together?",
                     f"There are {a} {x} on a table. {n} puts {b} more on it. How many {x} are on the table now?"))
    return text, [(a, "+", b)], a + b


def _sub(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a = r.randint(2, 20)
    b = r.randint(1, a)
    text = r.choice((f"{n} has {a} {x} and gives {b} to {m}. How many {x} does {n} have left?",
                     f"There are {a} {x} in a box. {n} takes out {b}. How many {x} are left in the box?",
                     f"{n} had {a} {x} and lost {b} of them. How many {x} does {n} have now?"))
    return text, [(a, "-", b)], a - b


def _mul(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a, b = r.randint(2, 9), r.randint(2, 9)
    text = r.choice((f"{n} has {a} {h} with {b} {x} in each. How many {x} does {n} have?",
                     f"{n} buys {a} {h} of {x}. Each of the {h} holds {b} {x}. How many {x} does {n} buy?"))
    return text, [(a, "*", b)], a * b


def _add_sub(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a, b = r.randint(2, 20), r.randint(1, 20)
    c = r.randint(1, a + b)
    text = (f"{n} has {a} {x}, buys {b} more, and then gives {c} to {m}. "
            f"How many {x} does {n} have now?")
    return text, [(a, "+", b), (a + b, "-", c)], a + b - c


def _sub_sub(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a = r.randint(3, 20)
    b = r.randint(1, a - 1)
    c = r.randint(1, a - b)
    text = f"{n} has {a} {x}. {n} loses {b} and then gives {c} to {m}. How many {x} does {n} have left?"
    return text, [(a, "-", b), (a - b, "-", c)], a - b - c


def _mul_add(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(2, 20)
    text = f"{n} has {c} {x} and buys {a} {h} with {b} {x} in each. How many {x} does {n} have now?"
    return text, [(a, "*", b), (a * b, "+", c)], a * b + c


def _mul_sub(r: random.Random, n: str, m: str, x: str, h: str) -> Story:
    a, b = r.randint(2, 9), r.randint(2, 9)
    c = r.randint(2, a * b)
    text = f"{n} has {a} {h} with {b} {x} in each and gives {c} {x} to {m}. How many {x} does {n} have left?"
    return text, [(a, "*", b), (a * b, "-", c)], a * b - c


TEMPLATES: tuple[Callable[..., Story], ...] = (_add, _sub, _mul, _add_sub, _sub_sub, _mul_add, _mul_sub)
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def solution(steps: list[tuple[int, str, int]], answer: int) -> str:
    lines = [f"{a} {op} {b} = {_APPLY[op](a, b)}." for a, op, b in steps]
    return "\n".join(lines + [f"The answer is \\boxed{{{answer}}}."])


def make_problem(split: str, index: int, seed: int) -> Problem:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"math:{seed}:{split}:{index}")
    while True:  # rejection keeps only prompts of this split
        name, other = rng.sample(NAMES, 2)
        text, steps, answer = rng.choice(TEMPLATES)(rng, name, other, rng.choice(THINGS), rng.choice(HOLDERS))
        if split_of(text) == split:
            return Problem(id=f"math-{split}-{index:06d}", prompt=text, answer=str(answer),
                           response=solution(steps, answer))


def make_problems(split: str, num: int, seed: int, *, start: int = 0) -> list[Problem]:
    """Problems start..start+num-1 of a split's stream."""
    if num < 0 or start < 0:
        raise ValueError(f"num and start must be >= 0, got num={num}, start={start}")
    return [make_problem(split, i, seed) for i in range(start, start + num)]


def write_jsonl(problems: list[Problem], path: Path) -> None:
    with atomic_file(path) as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer, "solution": p.response}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tasks.make_math", description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="train problems")
    parser.add_argument("--test", type=int, default=200, help="test problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    for split in SPLITS:
        num = getattr(args, split)
        if num <= 0:
            parser.error(f"--{split} must be > 0, got {num}")
        path = args.out_dir / f"math_{split}.jsonl"
        write_jsonl(make_problems(split, num, args.seed), path)
        print(f"wrote {num} {split} problems to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
