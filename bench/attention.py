"""`python -m bench.attention --model DIR`: the update's attention, torch's SDPA against TailSpec's
causal CPU kernels (actor.attention, pipeline/actors/attention.py), side by side in one process.

Two tables, rounds interleaved (SDPA, kernels, SDPA, ...), best of `--repeat`:
- the attention alone, forward and backward, per (rows x tokens) micro-batch shape at the model's
  heads and head dim (causal, GQA as the model has it);
- the model's forward and backward (the update's work per micro-batch: log-probs of right-padded
  rows, their sum's gradient), the same shapes, with each attention implementation.
With `--json` the last line is `{"ratio": {"attention RxT" | "model RxT": sdpa / kernels}, "ms",
"baseline_ms"}`.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.common import best_interleaved, cpu_model, finish, record_ms
from pipeline.actors.base import ActorConfig
from pipeline.actors.forward import forward_in, load_policy

# make train's micro-batches (512 padded tokens): a long row alone, then shorter rows sharing.
SHAPES = ((1, 800), (1, 512), (2, 256), (4, 128), (8, 64))


def attention_pass(impl: str, rows: int, tokens: int, hq: int, hkv: int, d: int):
    """A closure running one forward and backward of causal attention on fixed random inputs."""
    from engine.kernels.causal_attention import causal_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, tokens, hq, d, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(rows, tokens, hkv, d, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(rows, tokens, hkv, d, generator=g).transpose(1, 2).requires_grad_()
    grad = torch.randn(rows, tokens, hq, d, generator=g)

    def run():
        if impl == "sdpa":  # what transformers' SDPA path runs: kv heads repeated, then the causal kernel
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                                 is_causal=True).transpose(1, 2)
        else:
            out = causal_attention(q, k, v, d ** -0.5)
        out.backward(grad)

    return run


def model_pass(forward, rows: int, tokens: int, vocab: int):
    """A closure running the update's forward (`forward(ids, mask) -> LogProbs`, an actor model's
    forward_in) and backward on right-padded rows: the first row `tokens` long, the others shorter in
    steps (a micro-batch of rows longest first)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.zeros(rows, tokens, dtype=torch.long)
    for r in range(rows):
        mask[r, : tokens - r * tokens // (2 * rows)] = 1

    def run():
        lp = forward(ids, mask).logprobs
        lp.sum().backward()

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny-reason")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (make train: one per rank)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        models = {impl: load_policy(args.model, ActorConfig(attention=impl)) for impl in ("sdpa", "tailspec")}
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    c = models["sdpa"].config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    print(f"{cpu_model()}, {args.threads} thread(s); {args.model}: {hq} query heads, {hkv} kv heads, head dim {d}",
          file=sys.stderr)
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}}
    print(f"{'':>9} {'rows x tokens':>13} {'sdpa ms':>9} {'kernels ms':>10} {'ratio':>6}", file=sys.stderr)
    for what in ("attention", "model"):
        for rows, tokens in SHAPES:
            if what == "attention":
                runs = {impl: attention_pass(impl, rows, tokens, hq, hkv, d) for impl in models}
            else:
                runs = {impl: model_pass(forward_in(m, ActorConfig(attention=impl)), rows, tokens, c.vocab_size)
                        for impl, m in models.items()}
            best = best_interleaved(runs, args.repeat)
            key = f"{what} {rows}x{tokens}"
            record_ms(result, key, best["sdpa"], best["tailspec"])
            print(f"{what:>9} {rows:>6} x {tokens:<4} {best['sdpa'] * 1e3:>9.2f} {best['tailspec'] * 1e3:>10.2f} "
                  f"{best['sdpa'] / best['tailspec']:>6.2f}", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
