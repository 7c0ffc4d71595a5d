"""`python -m pipeline.data.prepare --format FORMAT IN OUT_DIR`: a downloaded dataset in the run's layout.

Reads IN (a .jsonl, .json or .parquet file, or a folder of them, e.g. MATH's per-problem JSON
files), converts each row from FORMAT (pipeline.data.layouts: gsm8k, math, verl, dapo, trl),
and writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl (or .parquet), split by a hash of each
row's id (pipeline.data.split): `--test-share s` puts the rows a run's `task.eval_share=s` would
hold out into test; 0 writes train only, 1 test only (a dataset's own test file). A run then
reads them with the default fields: `task.file=OUT_DIR/train.jsonl task.eval_file=OUT_DIR/test.jsonl`.

A bad row is reported as `file:line: what is wrong` and skipped, and the conversion stops past
`--max-bad-share` of the rows (as a run's load does); a row whose prompt an earlier row has
is dropped, keeping the first. A summary says how many rows were read, bad, dropped and written
where. TailSpec downloads nothing: IN is a file the user fetched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.atomic import atomic_file
from pipeline.data.fields import SUFFIXES, read_rows
from pipeline.data.files import MAX_SHOWN, BadRow, prompt_key, refuse_past_share
from pipeline.data.layouts import FORMATS, convert
from pipeline.data.split import is_held_out


def input_files(path: Path) -> list[Path]:
    """IN itself, or the data files under the folder IN, in sorted order."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{path} holds no {', '.join(SUFFIXES)} files")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    return [path]


def write_rows(rows: list[dict], path: Path) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with atomic_file(path, "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
        return
    with atomic_file(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def prepare(fmt: str, source: Path, out_dir: Path, *, test_share: float, suffix: str = ".jsonl",
            max_bad_share: float = 0.01) -> list[str]:
    """Converts and writes the split; returns the summary's lines."""
    if not 0.0 <= test_share <= 1.0:
        raise ValueError(f"--test-share must be in [0, 1], got {test_share}")
    files = input_files(source)
    rows, bad, duplicates, other_answer = 0, [], 0, 0
    split: dict[str, list[dict]] = {"train": [], "test": []}
    first: dict[str, str] = {}  # prompt key -> its first row's answer
    for path in files:
        for line, row in read_rows(path):
            rows += 1
            try:
                if isinstance(row, json.JSONDecodeError):
                    raise ValueError(f"not valid JSON ({row.msg})")
                converted = convert(fmt, row)
            except ValueError as e:
                bad.append(BadRow(str(path), line, str(e)))
                continue
            key = prompt_key(converted["prompt"])
            if key in first:
                duplicates += 1
                other_answer += first[key] != converted["answer"]
                continue
            first[key] = converted["answer"]
            split["test" if is_held_out(converted["id"], test_share) else "train"].append(converted)
    if not rows:
        raise ValueError(f"{source}: no rows")
    refuse_past_share(str(source), bad, rows, max_bad_share)
    summary = [f"{fmt}: {rows} rows from {source} ({len(files)} file{'s' * (len(files) > 1)}), {len(bad)} bad, "
               f"{duplicates} duplicate prompts dropped ({other_answer} with another answer)"]
    summary += [f"  {b}" for b in bad[:MAX_SHOWN]]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, kept in split.items():
        if (name == "train" and test_share < 1) or (name == "test" and test_share > 0):
            write_rows(kept, out_dir / f"{name}{suffix}")
            summary.append(f"{name}: {len(kept)} rows -> {out_dir / f'{name}{suffix}'}")
    summary.append(f"split by a hash of the id, test share {test_share:g}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.prepare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", required=True, choices=FORMATS, help="the input's layout")
    ap.add_argument("input", type=Path, help="a .jsonl / .json / .parquet file, or a folder of them")
    ap.add_argument("out_dir", type=Path, help="where train.jsonl and test.jsonl (or .parquet) go")
    ap.add_argument("--test-share", type=float, default=0.05, help="share of rows for test, by id hash (default 0.05)")
    ap.add_argument("--output-format", choices=("jsonl", "parquet"), default="jsonl")
    ap.add_argument("--max-bad-share", type=float, default=0.01, help="stop past this share of bad rows (default 0.01)")
    args = ap.parse_args(argv)
    try:
        lines = prepare(args.format, args.input, args.out_dir, test_share=args.test_share,
                        suffix=f".{args.output_format}", max_bad_share=args.max_bad_share)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
