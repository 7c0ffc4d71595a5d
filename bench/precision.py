"""`python -m bench.precision --model DIR`: the update in float32 against bf16-mixed (actor.precision,
pipeline/actors/precision.py), side by side in one process.

Two tables:
- speed: the model's forward and backward (the update's work per micro-batch) at `make train`'s
  micro-batch shapes, rounds interleaved (float32, bf16-mixed, float32, ...), best of `--repeat`;
- agreement: on worked solutions of the mult task (prompt + reference response, the text the tiny
  model was trained on), how far bf16-mixed log-probs are from float32's, and the share of tokens
  whose probability ratio leaves PPO's clip range [0.8, 1.2].
With `--json` the last line is `{"ratio": {"model RxT": float32 / bf16-mixed}, "ms", "baseline_ms",
"logprob_diff": {"mean", "p99", "max", "outside_clip"}, "bf16_native"}`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.attention import SHAPES, model_pass
from bench.common import best_interleaved, cpu_model, finish, record_ms
from pipeline.actors import precision
from pipeline.actors.base import ActorConfig
from pipeline.actors.forward import forward_in, load_policy

WAYS = ("float32", "bf16-mixed")


def agreement(models: dict, cfgs: dict, tokenizer, problems: int) -> dict[str, float]:
    """bf16-mixed against float32 log-probs on `problems` worked mult solutions, one row each."""
    from pipeline.tasks.mult import make_problems

    diffs = []
    for p in make_problems("test", problems, 0):
        ids = torch.tensor([tokenizer(p.prompt + p.response)["input_ids"]])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            lp = {way: forward_in(models[way], cfgs[way])(ids, mask).logprobs[0, 1:] for way in WAYS}
        diffs.append((lp["float32"] - lp["bf16-mixed"]).abs())
    d = torch.cat(diffs)
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max()),
            "outside_clip": float(((d.exp() > 1.2) | ((-d).exp() < 0.8)).float().mean()), "tokens": d.numel()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny-reason")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (make train: one per rank)")
    p.add_argument("--problems", type=int, default=64, help="worked mult solutions for the agreement table")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from common.text import load_tokenizer

    cfgs = {way: ActorConfig(precision=way) for way in WAYS}
    try:
        models = {way: load_policy(args.model, cfg) for way, cfg in cfgs.items()}
        tokenizer = load_tokenizer(args.model)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    native = precision.cpu_has_bf16()
    print(f"{cpu_model()}, {args.threads} thread(s), bf16 dot products: {'yes' if native else 'no (emulated)'}; "
          f"{args.model}", file=sys.stderr)
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}, "bf16_native": native}
    print(f"{'rows x tokens':>13} {'float32 ms':>10} {'bf16-mixed ms':>13} {'ratio':>6}", file=sys.stderr)
    vocab = models["float32"].config.vocab_size
    for rows, tokens in SHAPES:
        best = best_interleaved({way: model_pass(forward_in(models[way], cfgs[way]), rows, tokens, vocab)
                                 for way in WAYS}, args.repeat)
        record_ms(result, f"model {rows}x{tokens}", best["float32"], best["bf16-mixed"])
        print(f"{rows:>6} x {tokens:<4} {best['float32'] * 1e3:>10.2f} {best['bf16-mixed'] * 1e3:>13.2f} "
              f"{best['float32'] / best['bf16-mixed']:>6.2f}", file=sys.stderr)
    agree = agreement(models, cfgs, tokenizer, args.problems)
    result["logprob_diff"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in agree.items()}
    print(f"log-probs on {agree['tokens']} tokens of {args.problems} worked solutions, |bf16-mixed - float32|: "
          f"mean {agree['mean']:.2e}, p99 {agree['p99']:.2e}, max {agree['max']:.2e}; "
          f"outside PPO's clip range: {agree['outside_clip']:.3%}", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
