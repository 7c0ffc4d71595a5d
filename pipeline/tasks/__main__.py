"""Write problems of a task as JSONL: `python -m pipeline.tasks --task arith --split test --num N --seed S --out F`.

Each line is `{"id": ..., "prompt": ..., "answer": ...}`; reference responses are not written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.tasks import TASKS, get_task
from pipeline.tasks.arith import SPLITS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(sorted(TASKS))}")
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--num", type=int, required=True, help="number of problems (> 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output JSONL file")
    args = parser.parse_args(argv)
    if args.task not in TASKS:
        parser.error(f"unknown task {args.task!r}; available: {', '.join(sorted(TASKS))}")
    if args.num <= 0:
        parser.error(f"--num must be > 0, got {args.num}")
    if not args.out.parent.is_dir():
        parser.error(f"output folder {str(args.out.parent)!r} does not exist")

    problems = get_task(args.task).make_problems(args.split, args.num, args.seed)
    with args.out.open("w") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer}) + "\n")
    print(f"wrote {len(problems)} {args.task}/{args.split} problems to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
