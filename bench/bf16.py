"""`python -m bench.bf16 --model DIR --batch 1,8`: does streaming bf16 weights pay for decode here?

Three ways to run one model, side by side in one process, rounds interleaved (A B C A B C ...)
so a busy spell on a shared host hits all alike, best of `--repeat` rounds:
- `fp32`: the engine as shipped (float32 weights through the skinny kernels);
- `bf16w`: `engine.weights=bfloat16`: the same kernels streaming bf16 weights (half the bytes),
  float32 arithmetic;
- `torch-bf16`: `engine.dtype=bfloat16`: the model in bf16 through torch's own ops (oneDNN, AMX
  where the CPU has it), for reference.
Greedy decoding of the same chat prompts, `--new-tokens` each with no early stop; tok/s counts
new tokens over the whole call (prefill included).

Then how far each bf16 model is from float32's, teacher-forced on float32's greedy responses:
the largest |logit difference|, the mean KL(fp32 || other) per token, the share of positions
whose argmax agrees, and the share of responses whose greedy tokens equal float32's whole.
With `--json`, a last line `{"ratio": {B: bf16w / fp32}, "tok_s": {...}, "numerics": {...}}`.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.common import batch_list, chat_prompts, finish, timed
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.types import Request

MODES = {"fp32": {}, "bf16w": {"weights": "bfloat16"}, "torch-bf16": {"dtype": "bfloat16"}}


def generate(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [Request(prompt_id=f"bench-{i}", prompt=p) for i, p in enumerate(prompts)]
    return [r.tokens for r in engine.generate(reqs, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))]


@torch.inference_mode()
def forced_logits(engine: RolloutEngine, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), V] float32 logits predicting each response token (one teacher-forced pass)."""
    ids = torch.tensor([prompt + response[:-1]])
    out = engine.runtime(ids, torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 :]
    return out.float()


def numerics(ref: RolloutEngine, other: RolloutEngine, prompts, responses, other_tokens) -> dict:
    worst, kl, agree, n = 0.0, 0.0, 0, 0
    for p, r in zip(prompts, responses):
        a, b = forced_logits(ref, p, r), forced_logits(other, p, r)
        worst = max(worst, float((a - b).abs().max()))
        kl += float(F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="sum"))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += len(r)
    same = sum(x == y for x, y in zip(responses, other_tokens)) / len(responses)
    return {"max_abs_logit_diff": round(worst, 4), "kl_per_token": kl / n, "argmax_agree": round(agree / n, 4),
            "same_greedy_responses": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bf16", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--batch", type=batch_list, default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    try:
        engines = {m: RolloutEngine.from_pretrained(args.model, EngineConfig(max_batch=max(args.batch), max_len=1024, **kw))
                   for m, kw in MODES.items()}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = {b: chat_prompts(tokenizer, b) for b in args.batch}
    best = {(m, b): float("inf") for m in MODES for b in args.batch}
    tokens = {}
    for _ in range(args.repeat):
        for b in args.batch:
            for m, eng in engines.items():
                tokens[m, b], t = timed(lambda: generate(eng, prompts[b], args.new_tokens))
                best[m, b] = min(best[m, b], t)
    result = {"ratio": {}, "tok_s": {m: {} for m in MODES}, "numerics": {}, "new_tokens": args.new_tokens}
    print(f"{'batch':>5} " + " ".join(f"{m + ' tok/s':>16}" for m in MODES) + f" {'bf16w/fp32':>11} {'torch-bf16/fp32':>16}",
          file=sys.stderr)
    for b in args.batch:
        tok_s = {m: b * args.new_tokens / best[m, b] for m in MODES}
        for m in MODES:
            result["tok_s"][m][str(b)] = round(tok_s[m], 2)
        result["ratio"][str(b)] = round(tok_s["bf16w"] / tok_s["fp32"], 3)
        print(f"{b:>5} " + " ".join(f"{tok_s[m]:>16.1f}" for m in MODES)
              + f" {tok_s['bf16w'] / tok_s['fp32']:>11.2f} {tok_s['torch-bf16'] / tok_s['fp32']:>16.2f}", file=sys.stderr)
    b = max(args.batch)
    for m in ("bf16w", "torch-bf16"):
        result["numerics"][m] = numerics(engines["fp32"], engines[m], prompts[b], tokens["fp32", b], tokens[m, b])
        print(f"{m} against fp32 over {b} greedy responses: {result['numerics'][m]}", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
