"""`python -m bench.engine --model DIR --batch 1,8 [--baseline transformers|vllm]`: this engine against a baseline.

Both run greedy decoding of the same chat prompts for the same number of new tokens (no early
stop), best of `--repeat`; tokens/s counts new tokens over the wall time of the whole call
(prefill included). The transformers baseline (`generate`) runs in this process, one after the
other; the vLLM baseline runs in vLLM's own environment (`--vllm-python`, .venv-vllm from
`make setup-vllm`; bench.vllm_baseline) after this engine is done, so they never share the
cores. Prints a table, and with `--json` a last line `{"ratio": {B: ours/baseline}, "tok_s":
{...}, "baseline_tok_s": {...}, "baseline": ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from bench.common import chat_prompts, batch_list, timed, finish
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


def run_vllm(args, prompts: dict[str, list[list[int]]]) -> dict:
    """bench.vllm_baseline in vLLM's interpreter: {"B": {"tok_s", "tokens"}, "init_s"}."""
    if not os.access(args.vllm_python, os.X_OK):
        raise FileNotFoundError(f"--baseline vllm needs vLLM's interpreter at {args.vllm_python}: run `make setup-vllm` "
                                "(or pass --vllm-python)")
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/prompts.json", "w") as f:
            json.dump(prompts, f)
        cmd = [args.vllm_python, "-m", "bench.vllm_baseline", "--model", args.model, "--prompts", f"{tmp}/prompts.json",
               "--out", f"{tmp}/result.json", "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat)]
        proc = subprocess.run(cmd + (["--eager"] if args.vllm_eager else []), capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bench.vllm_baseline failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        with open(f"{tmp}/result.json") as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--batch", type=batch_list, default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both engines on it)")
    parser.add_argument("--baseline", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="vLLM's interpreter (make setup-vllm)")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = {str(b): chat_prompts(tokenizer, b) for b in batches}
    result = {"ratio": {}, "tok_s": {}, "baseline_tok_s": {}, "same_tokens": {}, "baseline": args.baseline}
    ours = {}
    for b in batches:
        ours[b] = timed(lambda: run_ours(engine, prompts[str(b)], args.new_tokens), args.repeat)
    if args.baseline == "vllm":
        del engine
        try:
            theirs = run_vllm(args, prompts)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        result["baseline_init_s"] = theirs.pop("init_s")
    else:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(args.device)
        theirs = {}
        for b in batches:
            tokens, t = timed(lambda: run_hf(hf, prompts[str(b)], args.new_tokens, pad), args.repeat)
            theirs[str(b)] = {"tok_s": b * args.new_tokens / t, "tokens": tokens}
    name = "vllm" if args.baseline == "vllm" else "hf"
    print(f"{'batch':>5} {'ours tok/s':>11} {name + ' tok/s':>11} {'ratio':>6} {'same tokens':>12}", file=sys.stderr)
    for b in batches:
        (tokens, t_ours), key = ours[b], str(b)
        ours_tok_s, base_tok_s = b * args.new_tokens / t_ours, theirs[key]["tok_s"]
        same = sum(a == c for a, c in zip(tokens, theirs[key]["tokens"])) / b
        result["tok_s"][key] = round(ours_tok_s, 2)
        result["baseline_tok_s"][key] = round(base_tok_s, 2)
        result["ratio"][key] = round(ours_tok_s / base_tok_s, 3)
        result["same_tokens"][key] = same
        print(f"{b:>5} {ours_tok_s:>11.1f} {base_tok_s:>11.1f} {ours_tok_s / base_tok_s:>6.2f} {same:>12.0%}", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
