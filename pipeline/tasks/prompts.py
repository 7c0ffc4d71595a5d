"""General instruction prompts from templates: `python -m pipeline.tasks.prompts --num N --out FILE [--split S] [--seed S]`.

Drafter warm-start for a chat model needs prompts like the ones it will answer, and nothing can
be downloaded, so prompts are composed: instruction templates x subjects, plus arithmetic word
problems with random numbers. Each line is `{"id": "<split>-<i>", "prompt": "..."}`; the draw
is deterministic in the split and the seed.

Splits: every fifth subject and every fourth item belong to `test` only, the rest to `train`, so
a test prompt never appears in a train file whatever the seeds (a drafter benchmarked on
prompts it was trained on would be measured on memorised responses: at T = 0 they are the very
same tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# New subjects and items go at the end, never in between: a value's split is fixed by its index.
SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes", "honey bees",
    "the human heart", "climate change", "the internet", "machine learning", "the Roman Empire", "coral reefs",
    "electricity", "the Moon", "vaccines", "democracy", "the printing press", "rainforests", "gravity",
    "the stock market", "DNA", "earthquakes", "the Great Wall of China", "recycling", "solar panels",
    "the immune system", "chess", "coffee", "penguins", "the Industrial Revolution", "airplanes",
    "the periodic table", "music theory", "sleep", "the ocean tides", "bread baking", "the Olympic Games",
    "renewable energy", "dinosaurs", "the solar system", "friendship", "time management", "a small village",
    "a lost robot", "a lighthouse keeper", "a dragon who is afraid of fire", "the first day at a new school",
    "glaciers", "ancient Egypt", "suspension bridges", "wind turbines", "the violin", "tea", "the Silk Road",
    "mushrooms", "whales", "the human brain", "money", "a talking cat", "deserts", "the telescope", "gardening",
    "the Renaissance", "submarines", "hurricanes", "the Pyramids of Giza", "electric cars", "yoga", "the Vikings",
    "spiders", "the blockchain", "tornadoes", "the human skeleton", "origami", "the Arctic", "bacteria",
    "the Eiffel Tower", "magnets", "the piano", "kangaroos", "the Cold War", "rain", "batteries", "cheese making",
    "the Milky Way", "soccer", "the Amazon rainforest", "elephants", "the Great Depression", "trains", "owls",
    "nuclear power", "the alphabet", "pizza", "the Himalayas", "butterflies", "the French language", "clouds",
    "the United Nations", "sharks", "plastic pollution", "the wheel", "jazz", "ants", "Mars", "the camera",
    "ancient Greece", "wolves", "the Sahara", "vitamins", "a haunted house", "a time traveller", "a brave knight",
    "a pirate ship", "a rainy afternoon", "a secret garden", "a talking tree", "the last day of summer",
    "a city on the Moon", "an old clock", "a friendly ghost", "a mountain climber", "a busy airport",
    "public libraries", "video games", "social media", "the immune response to a cold", "exercise", "breakfast",
    "the Roman Colosseum", "the printing of money", "satellites", "comets", "the Dead Sea", "chocolate",
    "bamboo", "frogs", "the Great Barrier Reef", "Shakespeare", "Albert Einstein", "Marie Curie", "the telephone",
    "cryptography", "the metric system", "bicycles in cities", "volunteering", "learning a language",
    "saving money", "public speaking", "first aid", "camping", "photography", "knitting", "the Mona Lisa",
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
    "How does {s} work? Keep it short.",
    "Tell me an interesting story involving {s}.",
    "Write a short news report about {s}.",
    "Give three tips for someone curious about {s}.",
    "Describe {s} in five sentences.",
    "What questions do people often ask about {s}? Answer two of them.",
)

NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena")
ITEMS = ("apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards")


SPLITS = ("train", "test")


def in_split(values: tuple[str, ...], every: int, split: str) -> tuple[str, ...]:
    """Every `every`-th value (the last of each run) is test-only; the others are train."""
    return tuple(v for i, v in enumerate(values) if (i % every == every - 1) == (split == "test"))


def word_problem(rng: random.Random, items: tuple[str, ...] = ITEMS) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(items)
    forms = (
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? Explain step by step.",
        f"{name} has {a + b} {item} and gives {b} to {other}. How many are left? Show your reasoning.",
        f"A box holds {c} {item}. {name} has {a} boxes. How many {item} is that in total? Solve step by step.",
        f"{name} shares {a * c} {item} equally among {c} friends. How many does each friend get? Explain.",
        f"{name} packs {c} {item} a day. How many days does it take to pack {a * c} {item}? Explain your answer.",
        f"{name} has {a} {item} and buys {b} packs of {c} {item}. How many {item} is that? Write it as {a} + {b} * {c}.",
    )
    return rng.choice(forms)


def make_prompts(num: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`num` prompts of `split`: about 3 in 4 from templates x subjects, the rest word problems; no duplicates while possible."""
    if num <= 0:
        raise ValueError(f"num must be > 0, got {num}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    subjects, items = in_split(SUBJECTS, 5, split), in_split(ITEMS, 4, split)
    rng = random.Random(f"spot.prompts:{split}:{seed}")  # the key of its first home: the same draws as before the move
    seen: set[str] = set()
    rows: list[dict] = []
    attempts = 0
    while len(rows) < num:
        attempts += 1
        if rng.random() < 0.75:
            s, t = rng.sample(subjects, 2)
            text = rng.choice(TEMPLATES).format(s=s, t=t)
        else:
            text = word_problem(rng, items)
        if text in seen and attempts < 100 * num:
            continue
        seen.add(text)
        rows.append({"id": f"{split}-{len(rows)}", "prompt": text})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.tasks.prompts", description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, required=True, help="number of prompts (> 0)")
    p.add_argument("--split", choices=SPLITS, default="train", help="train: drafter data; test: held-out subjects")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output JSONL file")
    args = p.parse_args(argv)
    if args.num <= 0:
        p.error(f"--num must be > 0, got {args.num}")
    if not args.out.parent.is_dir():
        p.error(f"output folder {str(args.out.parent)!r} does not exist")
    rows = make_prompts(args.num, args.seed, args.split)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} {args.split} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
