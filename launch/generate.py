"""`python -m launch.generate`: rollouts for a JSONL file of prompts, written as JSONL.

Input lines are `{"id": ..., "prompt": "..."}` (other fields are carried through untouched);
output lines carry `id, sample, prompt_tokens, tokens, text, logprobs, finish_reason`. The
model folder's tokenizer turns text into ids and back; `--chat` applies its chat template. The
engine itself sees only token ids. Progress goes to stderr, with a one-line summary at the end.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from common.atomic import atomic_file
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import DRAFTERS, SpecConfig
from engine.types import Request
from common.text import encode, load_tokenizer, read_prompts, stop_tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompts", required=True, help='JSONL with {"id": ..., "prompt": "..."} lines')
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=0, help="RL step (part of the noise key)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    s = p.add_argument_group("speculation (same tokens as --spec off, faster)")
    s.add_argument("--spec", default="off", choices=("off",) + DRAFTERS, help="drafter, or off")
    s.add_argument("--drafter", default=None, help="drafter folder for eagle / eagle3 (from spot.warmstart)")
    s.add_argument("--depth", type=int, default=6, help="draft levels per step")
    s.add_argument("--topk", type=int, default=1, help="children per expanded node (1 = chain)")
    s.add_argument("--verify-tokens", type=int, default=8, help="draft nodes verified per row per step")
    s.add_argument("--verify", default="coupled", choices=("coupled", "rejection"))
    return p


def run(args: argparse.Namespace) -> str:
    rows = read_prompts(args.prompts)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, step=args.step,
    )
    spec = SpecConfig(
        enabled=args.spec != "off", drafter=args.spec if args.spec != "off" else "eagle", drafter_path=args.drafter,
        depth=args.depth, topk=args.topk, verify_tokens=args.verify_tokens, verify=args.verify,
    )
    cfg = EngineConfig(max_batch=args.max_batch, max_len=args.max_len, dtype=args.dtype, threads=args.threads, spec=spec)
    engine = RolloutEngine.from_pretrained(args.model, cfg)
    tokenizer = load_tokenizer(args.model)
    params = SamplingParams(**{**params.__dict__, "stop_token_ids": stop_tokens(engine.model.config, tokenizer)})
    requests = [Request(prompt_id=str(r["id"]), prompt=encode(tokenizer, r["prompt"], args.chat), n=args.n) for r in rows]
    bar = tqdm(total=len(requests) * args.n, desc="rollouts", unit="seq", file=sys.stderr, disable=None)

    def progress(done: int) -> None:
        bar.update(done - bar.n)

    batch = engine.generate(requests, params, progress=progress)
    bar.close()
    with atomic_file(args.out) as f:
        for ro in batch:
            f.write(json.dumps({
                "id": ro.prompt_id, "sample": ro.sample, "prompt_tokens": ro.prompt_tokens, "tokens": ro.tokens,
                "text": tokenizer.decode(ro.tokens, skip_special_tokens=True), "logprobs": ro.logprobs,
                "finish_reason": ro.finish_reason.value,
            }) + "\n")
    s = batch.stats
    summary = (
        f"{len(batch)} rollouts, {s.new_tokens} tokens in {s.wall_s:.2f}s: {s.tokens_per_s:.1f} tok/s "
        f"(prefill {s.prefill_s:.2f}s, decode {s.decode_s:.2f}s, {len(s.batch_sizes)} steps) -> {args.out}"
    )
    if engine.drafter is not None:
        hist = {k: s.accept_hist.count(k) for k in sorted(set(s.accept_hist))}
        summary += (
            f"\nspec {engine.drafter.name}: accept length {s.accept_len:.2f}, accepted {s.accepted}/{s.drafted} drafts, "
            f"draft {s.draft_s:.2f}s, histogram {hist}"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        summary = run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
