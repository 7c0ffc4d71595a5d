"""`python -m bench.attention --model DIR`: the update's attention, torch's SDPA against TailSpec's
causal CPU kernels (actor.attention, pipeline/actors/attention.py), and the kernels in float32 against
their bf16 arithmetic (what bf16-mixed precision runs), side by side in one process.

Tables, rounds interleaved (one way, the other, ...), best of `--repeat`:
- the attention alone, forward and backward, per (rows x tokens) micro-batch shape at the model's
  heads and head dim (causal, GQA as the model has it): SDPA, the kernels, and where the kernels
  have AVX512_BF16 the kernels in bf16 arithmetic;
- the model's forward and backward (the update's work per micro-batch: log-probs of right-padded
  rows, their sum's gradient), the same shapes, in float32 with each attention implementation;
- where the CPU multiplies bf16 and the kernels have AVX512_BF16, the model's forward and backward
  in bf16-mixed precision with the kernels' float32 attention and with their bf16 one.
With `--json` the last line is `{"ratio": {"attention RxT" | "model RxT": sdpa / kernels}, "ms",
"baseline_ms", "bf16": {"attention RxT" | "model RxT": float32 kernels / bf16 kernels}, "bf16_ms"}`.
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
    """A closure running one forward and backward of causal attention on fixed random inputs
    (impl: "sdpa", "tailspec" the float32 kernels, "tailspec_bf16" the kernels in bf16 arithmetic)."""
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
            out = causal_attention(q, k, v, d ** -0.5, bf16=impl == "tailspec_bf16")
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


def bf16_models(path: str):
    """{"tailspec": model, "tailspec_bf16": model} in bf16-mixed precision with the kernels' float32
    attention and their bf16 one (the actor's pick), or {} where the CPU or the kernels lack bf16."""
    from engine.kernels.causal_attention import bf16_native
    from pipeline.actors import attention, precision

    if not (precision.cpu_has_bf16() and bf16_native()):
        return {}
    cfg = ActorConfig(precision="bf16-mixed")
    bf16 = load_policy(path, cfg)
    f32 = load_policy(path, cfg)
    f32.config._attn_implementation = attention.implementation(ActorConfig())  # the float32 kernels' name
    return {"tailspec": forward_in(f32, cfg), "tailspec_bf16": forward_in(bf16, cfg)}


def main(argv: list[str] | None = None) -> int:
    from engine.kernels.causal_attention import bf16_native

    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny-reason")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (make train: one per rank)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        models = {impl: load_policy(args.model, ActorConfig(attention=impl)) for impl in ("sdpa", "tailspec")}
        mixed = bf16_models(args.model)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    c = models["sdpa"].config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    bf16 = bf16_native() and d % 8 == 0
    print(f"{cpu_model()}, {args.threads} thread(s); {args.model}: {hq} query heads, {hkv} kv heads, head dim {d}",
          file=sys.stderr)
    result = {"ratio": {}, "ms": {}, "baseline_ms": {}, "bf16": {}, "bf16_ms": {}}
    extra = f" {'bf16 ms':>8} {'f32/bf16':>8}" if bf16 else ""
    print(f"{'':>9} {'rows x tokens':>13} {'sdpa ms':>9} {'kernels ms':>10} {'ratio':>6}" + extra, file=sys.stderr)
    for what in ("attention", "model"):
        for rows, tokens in SHAPES:
            if what == "attention":
                impls = ("sdpa", "tailspec", "tailspec_bf16") if bf16 else ("sdpa", "tailspec")
                runs = {impl: attention_pass(impl, rows, tokens, hq, hkv, d) for impl in impls}
            else:
                runs = {impl: model_pass(forward_in(m, ActorConfig(attention=impl)), rows, tokens, c.vocab_size)
                        for impl, m in models.items()}
            best = best_interleaved(runs, args.repeat)
            key = f"{what} {rows}x{tokens}"
            record_ms(result, key, best["sdpa"], best["tailspec"])
            line = (f"{what:>9} {rows:>6} x {tokens:<4} {best['sdpa'] * 1e3:>9.2f} {best['tailspec'] * 1e3:>10.2f} "
                    f"{best['sdpa'] / best['tailspec']:>6.2f}")
            if "tailspec_bf16" in best:
                record_bf16(result, key, best["tailspec"], best["tailspec_bf16"])
                line += f" {best['tailspec_bf16'] * 1e3:>8.2f} {best['tailspec'] / best['tailspec_bf16']:>8.2f}"
            print(line, file=sys.stderr)
    if mixed:
        print(f"bf16-mixed model {'rows x tokens':>13} {'f32 attn ms':>11} {'bf16 attn ms':>12} {'ratio':>6}", file=sys.stderr)
        for rows, tokens in SHAPES:
            best = best_interleaved({impl: model_pass(f, rows, tokens, c.vocab_size) for impl, f in mixed.items()},
                                    args.repeat)
            record_bf16(result, f"bf16-mixed model {rows}x{tokens}", best["tailspec"], best["tailspec_bf16"])
            print(f"{'':>16} {rows:>6} x {tokens:<4} {best['tailspec'] * 1e3:>11.2f} {best['tailspec_bf16'] * 1e3:>12.2f} "
                  f"{best['tailspec'] / best['tailspec_bf16']:>6.2f}", file=sys.stderr)
    else:
        print("bf16-mixed: not measured (this CPU does not multiply bf16 natively, or the kernels lack AVX512_BF16)",
              file=sys.stderr)
    finish(result, args.json)
    return 0


def record_bf16(result: dict, key: str, float32_s: float, bf16_s: float) -> None:
    result["bf16_ms"][key] = round(bf16_s * 1e3, 2)
    result["bf16"][key] = round(float32_s / bf16_s, 3)


if __name__ == "__main__":
    sys.exit(main())
