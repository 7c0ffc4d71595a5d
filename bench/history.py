"""`python -m bench.history [--model M] [--drafter D] [--task T] [--chat] [--temperature 1] [--prompts 16] [--n 4]
[--min-match 3,12] [--ways W,...] [--json]`: history drafts on a recurring step, against EAGLE and n-gram drafts, at the engine.

The task's first `--prompts` training problems, `--n` samples each, are rolled out at RL step 1
(the history: the prompt's responses of an earlier epoch, other noise) and then at step 2 by each
way, with a fixed chain (`--depth`, verify tokens the same): `eagle` (the drafter at --drafter),
`ngram`, and `history` alone, `history+ngram` and `history+eagle` at each `--min-match`. The
policy does not move between the two steps, so this is history's best case in that respect; the
noise differs, as between epochs. Counts are exact and repeatable (decode steps, accept length:
tokens emitted per row per speculative step, target tokens verified, the history drafter's share
of speculative row-steps and its accept length there); seconds are wall time on whatever shares
the machine. Every way's tokens must equal autoregressive decoding's (exit 2 otherwise).

Every prompt of step 2 recurs, so each way's accept length is over the same rows; each way also
reports it as a multiple of EAGLE's (`vs_eagle`). A history way reports EAGLE's accept length on
exactly the tokens its history-drafted row-steps emitted (`eagle_on_history_tokens`: the same
samples and positions, every way's tokens being the same; engine.row_steps) and its own as a
multiple of that (`history_vs_eagle`).
`--task`, `--chat` and `--temperature` give another model's setting (SmolLM2: `--task math --chat
--temperature 0.7`, as configs/smollm2.yaml samples); `--ways` runs a subset (autoregressive always).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import cpu_model, finish
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.compose import FallbackDrafter
from engine.spec.config import SpecConfig
from engine.row_steps import accept_on, row_step_tokens
from engine.spec.history import HistoryDrafter, history_counts, history_drafted, history_metrics
from engine.spec.history_index import HistoryStore
from engine.spec.ngram import NgramDrafter
from engine.types import Request, RolloutBatch


def ways(model, drafter_path: str, history: list, min_matches: list[int]) -> dict:
    """name -> (a function building the drafter, the history part's index or None)."""
    from engine.spec.eagle_drafter import EagleDrafter

    def store(k: int) -> HistoryStore:
        s = HistoryStore(min_match=k)
        for r in history:
            s.add(r.prompt_id, [r.tokens])
        return s

    eagle = lambda: EagleDrafter.load(drafter_path, model, expect="eagle")  # noqa: E731
    drafter = lambda k: HistoryDrafter(store(k), max_match=max(32, k))  # noqa: E731
    out = {"eagle": (eagle, None), "ngram": (NgramDrafter, None)}
    for k in min_matches:
        out[f"history k{k}"] = (lambda k=k: drafter(k), 0)
        out[f"history+ngram k{k}"] = (lambda k=k: FallbackDrafter([drafter(k), NgramDrafter()]), 0)
        out[f"history+eagle k{k}"] = (lambda k=k: FallbackDrafter([drafter(k), eagle()]), 0)
    return out


def summary(batch: RolloutBatch, seconds: float, source: int | None) -> dict:
    out = {"decode_steps": len(batch.steps), "accept_len": round(batch.stats.accept_len, 3),
           "target_tokens": sum(s.batch_size + sum(s.drafted) for s in batch.steps), "seconds": round(seconds, 2)}
    if source is not None:
        out |= {k.split("/")[1]: round(v, 3) for k, v in history_metrics(history_counts(batch.steps, source)).items()}
    return out


def against_eagle(results: dict, batches: dict[str, RolloutBatch], sources: dict[str, int | None]) -> None:
    """Adds to every speculative way its accept length as a multiple of EAGLE's (`vs_eagle`), and to a
    history way EAGLE's accept length on the tokens its history-drafted row-steps emitted
    (`eagle_on_history_tokens`) and its own there as a multiple of it (`history_vs_eagle`), where EAGLE ran."""
    if "eagle" not in batches:
        return
    eagle, costs = results["eagle"]["accept_len"], row_step_tokens(batches["eagle"])
    for name, way in results.items():
        if name == "autoregressive":
            continue
        way["vs_eagle"] = round(way["accept_len"] / eagle, 3)
        if sources.get(name) is not None and "history_accept_len" in way:
            drafted = row_step_tokens(batches[name], history_drafted(sources[name]))
            there = accept_on(drafted, costs)
            way["eagle_on_history_tokens"] = round(there, 3)
            way["history_vs_eagle"] = round(way["history_accept_len"] / there, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description="history drafts on a recurring step, against EAGLE and n-gram drafts, at the engine")
    p.add_argument("--model", default="checkpoints/tiny-reason")
    p.add_argument("--drafter", default="checkpoints/tiny-reason-drafter")
    p.add_argument("--task", default="mult")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=896)
    p.add_argument("--min-match", default="3,12", help="history_min_match values, each for every history way (comma-separated)")
    p.add_argument("--chat", action="store_true", help="prompts as the user turn of the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=1024, help="the engine's tokens a row (prompt + response)")
    p.add_argument("--ways", default=None, help="comma-separated subset of the ways (default: all); autoregressive always runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from common.text import encode, load_tokenizer, stop_tokens
    from pipeline.tasks import get_task

    try:
        min_matches = [int(k) for k in args.min_match.split(",")]
        tok = load_tokenizer(args.model)
        model = load_checkpoint(args.model, torch.float32, "cpu")
        problems = get_task(args.task).make_problems("train", args.prompts, 0)
        prompts = [list(encode(tok, q.prompt, args.chat)) for q in problems]
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    requests = lambda: [Request(prompt_id=q.id, prompt=ids, n=args.n) for q, ids in zip(problems, prompts)]  # noqa: E731
    cfg = EngineConfig(max_batch=args.prompts * args.n, max_len=args.max_len,
                       spec=SpecConfig(depth=args.depth, verify_tokens=args.depth))
    stops = stop_tokens(model.config, tok)
    params = lambda step: SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=0,  # noqa: E731
                                         step=step, stop_token_ids=stops)
    chosen = ways(model, args.drafter, [], min_matches)
    if args.ways is not None:
        wanted = [w.strip() for w in args.ways.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in chosen]
        if unknown:
            print(f"error: --ways {','.join(unknown)}: not a way; choose from {', '.join(chosen)}", file=sys.stderr)
            return 1
    plain = RolloutEngine(model, cfg)
    history = plain.generate(requests(), params(1))
    t = time.perf_counter()
    reference = plain.generate(requests(), params(2))
    results = {"autoregressive": summary(reference, time.perf_counter() - t, None)}
    identical = True
    batches, sources = {}, {}
    for name, (make, source) in ways(model, args.drafter, list(history), min_matches).items():
        if args.ways is not None and name not in wanted:
            continue
        engine = RolloutEngine(model, cfg, make())
        t = time.perf_counter()
        batch = engine.generate(requests(), params(2))
        results[name] = summary(batch, time.perf_counter() - t, source)
        batches[name], sources[name] = batch, source
        identical &= [r.tokens for r in batch] == [r.tokens for r in reference]
        print(f"{name:<20} " + "  ".join(f"{k} {v}" for k, v in results[name].items()), file=sys.stderr, flush=True)
    if identical:  # the same tokens in every way: their row-steps can be compared token by token
        against_eagle(results, batches, sources)
    finish({"ways": results, "identical": identical, "cpu": cpu_model(), "prompts": args.prompts, "n": args.n,
            "depth": args.depth, "temperature": args.temperature, "task": args.task,
            "tokens": sum(len(r.tokens) for r in reference)}, args.json)
    return 0 if identical else 2


if __name__ == "__main__":
    sys.exit(main())
