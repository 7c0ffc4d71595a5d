"""`python -m bench.forward --model DIR`: model forward time as loaded and as the engine runs it.

One forward of T new tokens per row after a 64-token context, per (rows, new tokens) shape, best
of `--repeat`: the model as loaded (HF weight layout, one module per op) against the model as
the engine's runtime runs it (`engine.runtime.TargetRuntime`: packed layers, and on a CPU the
compiled kernels where they build). T > 1 is the cost of a verify pass. With `--json` the last line is
`{"ratio": {"RxT": loaded / engine}, "ms": {...}, "baseline_ms": {...}}`.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.common import record_ms, finish
from bench.spec import forward_costs
from engine.checkpoint import load_checkpoint
from engine.runtime import TargetRuntime

SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (8, 1), (4, 9))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.forward", description=__doc__.splitlines()[0])
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
    ours = TargetRuntime(copy.deepcopy(plain))
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}}
    print(f"{'rows x tokens':>13} {'loaded ms':>10} {'engine ms':>10} {'ratio':>6}", file=sys.stderr)
    for rows, width in SHAPES:
        key = f"{rows}x{width}"
        base = forward_costs(plain, (width,), batch=rows, repeat=args.repeat)[str(width)]
        new = forward_costs(ours, (width,), batch=rows, repeat=args.repeat)[str(width)]
        record_ms(result, key, base, new)
        print(f"{key:>13} {base * 1e3:>10.2f} {new * 1e3:>10.2f} {base / new:>6.2f}", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
