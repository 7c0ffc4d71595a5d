"""`python -m bench.spec --model M --drafter D --batch 1,4,16`: speculative against autoregressive.

Both engines hold the same weights (each its own copy: a runtime packs its model) and run the same requests in one process, one after the other (best
of `--repeat`); the tokens must be identical (the run fails otherwise). Prints tokens/s of both,
the ratio and the acceptance length (tokens emitted per row per verify step) per batch size;
`--cost-model` adds the measured costs that bound the speedup on this machine: target forward
time for 1, 2, 4, 8, 16 tokens per row and the drafter's time per step. `--json` ends with one
line `{"ratio": {B: spec/ar}, "accept_len": {...}, "identical": true, ...}`.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from bench.common import chat_prompts, batch_list, timed, finish
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.kv_cache import KVCache
from engine.runtime import TargetRuntime
from engine.sampling import SamplingParams
from engine.spec.config import DRAFTERS, SpecConfig
from engine.spec.factory import build_drafter
from engine.types import GenerateStats, Request


def bench_prompts(model_dir: str, tokenizer, n: int, prompts_file: str | None) -> list[list[int]]:
    if prompts_file:
        from common.text import encode, read_prompts

        rows = read_prompts(prompts_file)
        chat = bool(getattr(tokenizer, "chat_template", None))
        return [encode(tokenizer, rows[i % len(rows)]["prompt"], chat) for i in range(n)]
    if getattr(tokenizer, "chat_template", None):
        return chat_prompts(tokenizer, n)
    from pipeline.tasks import get_task

    problems = get_task("arith").make_problems("test", n, 1234)
    return [tokenizer(p.prompt)["input_ids"] for p in problems]


def forward_costs(runtime, widths=(1, 2, 4, 8, 16), batch: int = 1, prefix: int = 64, repeat: int = 5) -> dict[str, float]:
    """Seconds per target forward of `w` new tokens per row after a `prefix`-token context;
    `runtime`: a TargetRuntime (as the engine runs the model) or a Transformer (its modules)."""
    model = runtime.model if isinstance(runtime, TargetRuntime) else runtime
    cache = KVCache.for_model(model.config, batch, prefix + max(widths) + 1, model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, prefix))
    out = {}
    with torch.inference_mode():
        runtime(ids, torch.arange(prefix).expand(batch, prefix), cache=cache)
        for w in widths:
            pos = prefix + torch.arange(w).expand(batch, w)
            x = torch.randint(0, model.config.vocab_size, (batch, w))
            _, t = timed(lambda: runtime(x, pos, cache=cache), repeat)
            out[str(w)] = t
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", default=None, help="drafter folder (eagle / eagle3)")
    p.add_argument("--spec", default=None, choices=DRAFTERS, help="default: eagle if --drafter else ngram")
    p.add_argument("--batch", type=batch_list, default="1,4,16")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--verify-tokens", type=int, default=8)
    p.add_argument("--min-confidence", type=float, default=0.0,
                   help="chains: end a row's draft once the drafter's confidence in it falls below this (0: full depth)")
    p.add_argument("--drafter-weights", default="float32", choices=("float32", "bfloat16"),
                   help="the CPU kernels' copy of an EAGLE drafter's weights (engine.spec.drafter_weights)")
    p.add_argument("--drafter-products", default="float32", choices=("float32", "bf16", "auto"),
                   help="an EAGLE drafter's kernel products (engine.spec.drafter_products)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: chat prompts, or arith problems)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4, help="distinct request sets per batch size (totals summed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost-model", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    batches = args.batch
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    name = args.spec or ("eagle" if args.drafter else "ngram")
    try:
        target = load_checkpoint(args.model, device=args.device)
        spec = SpecConfig(enabled=True, drafter=name, drafter_path=args.drafter, depth=args.depth, topk=args.topk,
                          verify_tokens=args.verify_tokens, min_confidence=args.min_confidence,
                          drafter_weights=args.drafter_weights, drafter_products=args.drafter_products)
        base = EngineConfig(max_batch=max(batches), max_len=2048, device=args.device)
        ar = RolloutEngine(copy.deepcopy(target), base)  # one runtime per model: each packs its own
        sp = RolloutEngine(target, EngineConfig(max_batch=max(batches), max_len=2048, device=args.device, spec=spec),
                           build_drafter(spec, target))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stops = tuple(target.config.eos_ids)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p, stop_token_ids=stops)
    result = {"ratio": {}, "accept_len": {}, "tok_s": {}, "baseline_tok_s": {}, "identical": True,
              "drafter": name, "depth": args.depth, "topk": args.topk, "verify_tokens": args.verify_tokens,
              "min_confidence": args.min_confidence, "drafter_weights": args.drafter_weights,
              "drafter_products": args.drafter_products,
              "temperature": args.temperature}
    print(f"{'batch':>5} {'spec tok/s':>10} {'ar tok/s':>9} {'ratio':>6} {'accept len':>10} {'draft s':>8} {'verify s':>8}", file=sys.stderr)
    warm = [Request(prompt_id="warm-up", prompt=bench_prompts(args.model, tokenizer, 1, args.prompts)[0])]
    for engine in (ar, sp):  # first calls pay one-time costs (allocation, kernel loading): not timed
        engine.generate(warm, SamplingParams(max_new_tokens=8, temperature=args.temperature, stop_token_ids=stops))
    for b in batches:
        prompts = bench_prompts(args.model, tokenizer, b * args.rounds, args.prompts)
        t_ar = t_sp = 0.0
        tokens, same, s, s_ar = 0, True, GenerateStats(), GenerateStats()
        for r in range(args.rounds):  # one request set per round: batch-1 figures over several prompts
            reqs = [Request(prompt_id=f"bench-{r * b + i}", prompt=x) for i, x in enumerate(prompts[r * b : (r + 1) * b])]
            ref, t = timed(lambda: ar.generate(reqs, params), args.repeat)
            t_ar += t
            s_ar.merge(ref.stats)
            out, t = timed(lambda: sp.generate(reqs, params), args.repeat)
            t_sp += t
            same &= all(a.tokens == c.tokens for a, c in zip(ref, out))
            tokens += sum(len(x.tokens) for x in ref)
            s.merge(out.stats)
        result["identical"] &= same
        key = str(b)
        result["tok_s"][key] = round(tokens / t_sp, 2)
        result["baseline_tok_s"][key] = round(tokens / t_ar, 2)
        result["ratio"][key] = round(t_ar / t_sp, 3)
        result["accept_len"][key] = round(s.accept_len, 3)
        result.setdefault("draft_step_s", {})[key] = round(s.draft_s / max(len(s.batch_sizes), 1), 5)
        result.setdefault("step_s", {})[key] = round(t_sp / max(len(s.batch_sizes), 1), 5)  # wall per step, prefill included
        result.setdefault("baseline_step_s", {})[key] = round(t_ar / max(len(s_ar.batch_sizes), 1), 5)
        print(f"{b:>5} {tokens / t_sp:>10.1f} {tokens / t_ar:>9.1f} {t_ar / t_sp:>6.2f} {s.accept_len:>10.2f} "
              f"{s.draft_s:>8.2f} {s.decode_s:>8.2f}{'' if same else '  TOKENS DIFFER'}", file=sys.stderr)
    if args.cost_model:
        costs = forward_costs(sp.runtime)
        result["forward_s"] = {k: round(v, 5) for k, v in costs.items()}
        b1 = str(batches[0])
        draft_step = result["draft_step_s"][b1]
        print("target forward, batch 1: " + ", ".join(f"{k} tok {v * 1e3:.1f} ms" for k, v in costs.items()), file=sys.stderr)
        print("drafter per step: " + ", ".join(f"batch {k} {v * 1e3:.2f} ms" for k, v in result["draft_step_s"].items()), file=sys.stderr)
        print("wall per step (spec / autoregressive): " + ", ".join(
            f"batch {k} {result['step_s'][k] * 1e3:.2f} / {result['baseline_step_s'][k] * 1e3:.2f} ms" for k in result["step_s"]), file=sys.stderr)
        if b1 in result["accept_len"]:
            w = min((int(k) for k in costs), key=lambda k: abs(k - (args.verify_tokens + 1)))
            bound = result["accept_len"][b1] * costs["1"] / (costs[str(w)] + draft_step)
            result["implied_ratio"] = round(bound, 3)
            print(f"implied speedup at batch {b1}: accept {result['accept_len'][b1]:.2f} x fwd(1) / (fwd({w}) + draft) = {bound:.2f}", file=sys.stderr)
    finish(result, args.json)
    return 0 if result["identical"] else 2


if __name__ == "__main__":
    sys.exit(main())
