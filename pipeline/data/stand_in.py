"""Stand-in files in the public layouts, from the built-in word problems: for trying a recipe here.

    python -m pipeline.data.stand_in --layout gsm8k|verl OUT [--rows 200] [--seed 0]

A recipe (examples/) starts from a dataset the user downloads; on a machine without one, or in a
rehearsal of the cluster job (launch.slurm.rehearse), this writes `pipeline.tasks.make_math`'s problems
in the layout that dataset has, so that the recipe's own `prepare` step reads them exactly as it
reads the real file:

- `gsm8k` (JSONL): `question`, and `answer` = the worked steps then `#### N`, GSM8K's layout;
- `verl` (parquet): `data_source`, `prompt` as one chat message, `ability`, `reward_model`
  (`style: rule`, `ground_truth`), `extra_info` (`split`, `index`), verl's and DAPO-Math-17k's.

No id is written (the public files have none). The problems are arithmetic stories, far easier
than GSM8K or DAPO-Math-17k: a stand-in for the format, not for the data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.atomic import atomic_file
from pipeline.tasks.arith import Problem
from pipeline.tasks.make_math import make_problems

LAYOUTS = ("gsm8k", "verl")


def gsm8k_row(p: Problem) -> dict:
    steps = p.response.rsplit("\n", 1)[0]  # the worked steps, without the boxed answer line
    return {"question": p.prompt, "answer": f"{steps}\n#### {p.answer}"}


def verl_row(p: Problem, index: int) -> dict:
    return {"data_source": "tailspec/stand-in", "prompt": [{"role": "user", "content": p.prompt}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"split": "train", "index": index}}


def write_stand_in(layout: str, out: Path, rows: int, seed: int = 0) -> Path:
    """`rows` train-split word problems in `layout` at `out` (atomically); -> out."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    problems = make_problems("train", rows, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout == "gsm8k":
        with atomic_file(out) as f:
            for p in problems:
                f.write(json.dumps(gsm8k_row(p)) + "\n")
        return out
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([verl_row(p, i) for i, p in enumerate(problems)])
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.data.stand_in", description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, choices=LAYOUTS)
    p.add_argument("out", type=Path, help="the file to write (.jsonl for gsm8k, .parquet for verl)")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    want = {"gsm8k": ".jsonl", "verl": ".parquet"}[args.layout]
    if args.out.suffix != want:
        p.error(f"--layout {args.layout} writes {want}; name the output file *{want}")
    try:
        write_stand_in(args.layout, args.out, args.rows, args.seed)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {args.rows} word problems in {args.layout}'s layout to {args.out} (a stand-in for the format, "
          "not the dataset)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
