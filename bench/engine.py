"""`python -m bench.engine --model DIR --batch 1,8`: this engine against transformers `generate`.

Both run greedy decoding of the same chat prompts for the same number of new tokens (no early
stop) in one process, one after the other, best of `--repeat`; tokens/s counts new tokens over
the wall time of the whole call (prefill included). Prints a table, and with `--json` a last
line `{"ratio": {B: ours/baseline}, "tok_s": {...}, "baseline_tok_s": {...}}`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import chat_prompts, emit_json, batch_list, timed
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.types import Request


def run_ours(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [Request(prompt_id=f"bench-{i}", prompt=p) for i, p in enumerate(prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return [r.tokens for r in engine.generate(reqs, params)]


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--batch", type=batch_list, default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both engines on it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    batches = args.batch
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        engine = RolloutEngine.from_pretrained(args.model, EngineConfig(max_batch=max(batches), max_len=1024,
                                                                           device=args.device))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(args.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = {"ratio": {}, "tok_s": {}, "baseline_tok_s": {}, "same_tokens": {}}
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'same tokens':>12}", file=sys.stderr)
    for b in batches:
        prompts = chat_prompts(tokenizer, b)
        n_new = b * args.new_tokens
        ours, t_ours = timed(lambda: run_ours(engine, prompts, args.new_tokens), args.repeat)
        theirs, t_hf = timed(lambda: run_hf(hf, prompts, args.new_tokens, pad), args.repeat)
        same = sum(a == c for a, c in zip(ours, theirs)) / b
        key = str(b)
        result["tok_s"][key] = round(n_new / t_ours, 2)
        result["baseline_tok_s"][key] = round(n_new / t_hf, 2)
        result["ratio"][key] = round(t_hf / t_ours, 3)
        result["same_tokens"][key] = same
        print(f"{b:>5} {n_new / t_ours:>11.1f} {n_new / t_hf:>9.1f} {t_hf / t_ours:>6.2f} {same:>12.0%}", file=sys.stderr)
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
