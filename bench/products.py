"""`python -m bench.products`: skinny matrix products, torch's GEMM against engine/kernels/skinny.

Times one pass over `--layers` layers' worth of a decoder's products (SmolLM2's shapes by default:
fused qkv 576x960, o 576x576, gate-up 576x3072, down 1536x576; random weights, 425 MB for 30
layers, so they stream from memory as in a real forward) for M rows, best of `--repeat`. This is
what a decode step (M = batch) or a verify pass (M = batch x tokens) spends in products; it is
how the kernel's per-host tuning is checked (engine/kernels/tune.py): prefill and teacher-forced
passes are row counts too (8 prompts x 256 tokens: 2048). The kernel runs with this host's tuned
parameters, also where the engine's guard turned it off. `--json`: `{"ratio": {M: torch / skinny},
"kernels": the kernel report, ...}`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import batch_list, emit_json, print_host, record_ms, timed
from engine.kernels.library import KernelUnavailable, library
from engine.kernels.skinny import SkinnyMatrix

SMOLLM2 = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.products", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=batch_list, default="1,2,4,8,16,32,64,128,256,512,1024")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)  # before the kernels load: they are tuned for this count
    try:
        library()
    except KernelUnavailable as e:
        print(f"error: the CPU kernels are unavailable here: {e}", file=sys.stderr)
        return 1
    print_host()
    torch.manual_seed(0)
    weights = [[torch.randn(k, n) * 0.02 for k, n in SMOLLM2] for _ in range(args.layers)]
    packed = [[SkinnyMatrix(w) for w in layer] for layer in weights]
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}}
    print(f"{'rows':>5} {'torch ms':>9} {'skinny ms':>10} {'ratio':>6}", file=sys.stderr)
    for m in args.rows:
        x = {k: torch.randn(m, k) for k in {k for k, _ in SMOLLM2}}

        def with_torch():
            for layer in weights:
                for w in layer:
                    x[w.shape[0]] @ w

        def with_skinny():
            for layer in packed:
                for sm in layer:
                    sm.matmul(x[sm.K])

        _, base = timed(with_torch, args.repeat)
        _, ours = timed(with_skinny, args.repeat)
        record_ms(result, str(m), base, ours)
        print(f"{m:>5} {base * 1e3:>9.1f} {ours * 1e3:>10.1f} {base / ours:>6.2f}", file=sys.stderr)
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
