"""`python -m bench.layout --model DIR`: model forward time with HF's weight layout and engine.layout's.

One decode forward (after a 64-token context) per (rows, new tokens) shape, best of `--repeat`,
for the model as loaded and with Linear weights stored as contiguous [in, out]. With `--json`
the last line is `{"ratio": {"RxT": hf / ours}, "ms": {...}, "baseline_ms": {...}}`.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.common import emit_json
from bench.spec import forward_costs
from engine.checkpoint import load_checkpoint
from engine.layout import transpose_storage

SHAPES = ((1, 1), (8, 1), (1, 9), (4, 9))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layout", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        plain = load_checkpoint(args.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ours = transpose_storage(copy.deepcopy(plain))
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}}
    print(f"{'rows x tokens':>13} {'HF layout ms':>12} {'[in, out] ms':>12} {'ratio':>6}", file=sys.stderr)
    for rows, width in SHAPES:
        key = f"{rows}x{width}"
        base = forward_costs(plain, (width,), batch=rows, repeat=args.repeat)[str(width)] * 1e3
        new = forward_costs(ours, (width,), batch=rows, repeat=args.repeat)[str(width)] * 1e3
        result["baseline_ms"][key], result["ms"][key], result["ratio"][key] = round(base, 2), round(new, 2), round(base / new, 3)
        print(f"{key:>13} {base:>12.1f} {new:>12.1f} {base / new:>6.2f}", file=sys.stderr)
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
