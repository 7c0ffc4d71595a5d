"""General instruction prompts from templates: `python -m spot.prompts --num N --out FILE [--seed S]`.

Drafter warm-start for a chat model needs prompts like the ones it will answer, and nothing can
be downloaded, so prompts are composed: instruction templates x subjects, plus arithmetic word
problems with random numbers. Each line is `{"id": "gen-<i>", "prompt": "..."}`; the draw is
deterministic in the seed, and different seeds give different mixes of the same families.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes", "honey bees",
    "the human heart", "climate change", "the internet", "machine learning", "the Roman Empire", "coral reefs",
    "electricity", "the Moon", "vaccines", "democracy", "the printing press", "rainforests", "gravity",
    "the stock market", "DNA", "earthquakes", "the Great Wall of China", "recycling", "solar panels",
    "the immune system", "chess", "coffee", "penguins", "the Industrial Revolution", "airplanes",
    "the periodic table", "music theory", "sleep", "the ocean tides", "bread baking", "the Olympic Games",
    "renewable energy", "dinosaurs", "the solar system", "friendship", "time management", "a small village",
    "a lost robot", "a lighthouse keeper", "a dragon who is afraid of fire", "the first day at a new school",
)

TEMPLATES = (
    "Explain {s} in simple terms.",
    "Explain {s} to a ten-year-old.",
    "Write a short story about {s}.",
    "Write a short poem about {s}.",
    "List five facts about {s}.",
    "What are the main advantages and disadvantages of {s}?",
    "Give me a brief history of {s}.",
    "Summarize what everyone should know about {s} in one paragraph.",
    "Write three quiz questions about {s}, with answers.",
    "Why is {s} important?",
    "Describe {s} as if you were a tour guide.",
    "What are common misconceptions about {s}?",
    "Write a short dialogue between two friends talking about {s}.",
    "How would you teach a class about {s}? Give a short lesson plan.",
    "Compare {s} with {t}.",
)

NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena")
ITEMS = ("apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards")


def word_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    forms = (
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? Explain step by step.",
        f"{name} has {a + b} {item} and gives {b} to {other}. How many are left? Show your reasoning.",
        f"A box holds {c} {item}. {name} has {a} boxes. How many {item} is that in total? Solve step by step.",
        f"{name} shares {a * c} {item} equally among {c} friends. How many does each friend get? Explain.",
        f"{name} reads {c} pages a day. How many days does a {a * c}-page book take? Explain your answer.",
        f"What is {a} + {b} * {c}? Explain the order of operations.",
    )
    return rng.choice(forms)


def make_prompts(num: int, seed: int = 0) -> list[dict]:
    """`num` prompts: about 3 in 4 from templates x subjects, the rest word problems; no duplicates while possible."""
    if num <= 0:
        raise ValueError(f"num must be > 0, got {num}")
    rng = random.Random(f"spot.prompts:{seed}")
    seen: set[str] = set()
    rows: list[dict] = []
    attempts = 0
    while len(rows) < num:
        attempts += 1
        if rng.random() < 0.75:
            s, t = rng.sample(SUBJECTS, 2)
            text = rng.choice(TEMPLATES).format(s=s, t=t)
        else:
            text = word_problem(rng)
        if text in seen and attempts < 100 * num:
            continue
        seen.add(text)
        rows.append({"id": f"gen-{len(rows)}", "prompt": text})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spot.prompts", description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, required=True, help="number of prompts (> 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output JSONL file")
    args = p.parse_args(argv)
    if args.num <= 0:
        p.error(f"--num must be > 0, got {args.num}")
    if not args.out.parent.is_dir():
        p.error(f"output folder {str(args.out.parent)!r} does not exist")
    rows = make_prompts(args.num, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
