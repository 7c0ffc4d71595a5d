"""`python -m bench.contention [--model DIR] [--drafter DIR] [--rows 16] [--chunk-windows 1] [--json]`: does spot training on
one core slow a rollout on another core of this host?

Spot training is free when the ranks that train in their idle windows do not slow the ranks still
generating. On GPUs they are separate devices. On a CPU host the cores share caches, memory
bandwidth and, on some virtual machines, a physical core: an idle rank's training can slow the
straggler it waits for, and `bench.spot`'s step ratio then measures the host, not the method.

This bench generates one rank's shard of the tiny config (16 prompts x 8 samples, one thread)
alone and while a second process runs spot-training micro-steps of the config's size (a
SpotTrainer on the drafter, `--rows` rows each, run `--chunk-windows` windows of pairs at a time
(0: all at once), one thread), alternating the order, and prints
the median generate time of each and their ratio. `--json` ends with
`{"alone_s", "with_training_s", "slowdown", "rows", "chunk_windows", "cpu"}`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from bench.common import cpu_model, finish
from spot.config import SpotConfig


def shard(model: str, prompts: int):
    from common.text import load_tokenizer
    from pipeline.rollout.stage import encode_problem
    from pipeline.tasks import get_task

    tok = load_tokenizer(model)
    problems = get_task("arith").make_problems("train", prompts, 0)
    return tok, [encode_problem(tok, p, False) for p in problems]


def train_forever(model: str, drafter: str, rows: int, chunk: int | None, ready, stop) -> None:
    """A spot trainer's micro-steps on the target's own features of the shard's prompts, until stop."""
    torch.set_num_threads(1)
    from engine.checkpoint import load_checkpoint
    from engine.spec.eagle import EagleModel
    from spot.training.features import TokenSequence, capture_features
    from spot.training.trainer import SpotTrainer

    target = load_checkpoint(model)
    net = EagleModel.load(drafter, target)
    tok, ids = shard(model, 64)
    g = torch.Generator().manual_seed(0)
    seqs = [TokenSequence(f"p{i}", 0, p + torch.randint(3, target.config.vocab_size, (120,), generator=g).tolist(), len(p))
            for i, p in enumerate(ids)]
    data = capture_features(target, seqs, net.config.aux_layers)
    trainer = SpotTrainer(net, SpotConfig().optim(), rows_per_step=rows, chunk_windows=chunk)
    ready.set()
    i = 0
    while not stop.is_set():
        trainer.micro_step([data[(i + j) % len(data)] for j in range(rows)])
        i += rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny")
    p.add_argument("--drafter", default="checkpoints/tiny-drafter")
    p.add_argument("--rows", type=int, default=16, help="rows per spot micro-step (spot.rows_per_step)")
    p.add_argument("--chunk-windows", type=int, default=SpotConfig().chunk_windows,
                   help="windows of pairs per forward/backward (spot.chunk_windows); 0: the whole micro-step at once")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.sampling import SamplingParams
    from engine.types import Request

    try:
        tok, ids = shard(args.model, 16)
        engine = RolloutEngine.from_pretrained(args.model, EngineConfig(max_batch=128, max_len=512))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e} (make pretrain-tiny drafters builds the tiny model and its drafter)", file=sys.stderr)
        return 1
    requests = [Request(prompt_id=f"p{i}", prompt=x, n=8) for i, x in enumerate(ids)]
    ctx = mp.get_context("spawn")
    times: dict[str, list[float]] = {"alone": [], "with_training": []}
    for r in range(args.rounds):
        for mode in (("alone", "with_training") if r % 2 else ("with_training", "alone")):
            proc = None
            if mode == "with_training":
                ready, stop = ctx.Event(), ctx.Event()
                proc = ctx.Process(target=train_forever, args=(args.model, args.drafter, args.rows, args.chunk_windows or None, ready, stop), daemon=True)
                proc.start()
                if not ready.wait(120):
                    proc.kill()
                    print("error: the training process did not start within 120 s", file=sys.stderr)
                    return 1
            params = SamplingParams(max_new_tokens=384, temperature=1.0, seed=r, step=r, stop_token_ids=(tok.eos_token_id,))
            t = time.perf_counter()
            engine.generate(requests, params)
            times[mode].append(time.perf_counter() - t)
            if proc is not None:
                stop.set()
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            print(f"round {r + 1}/{args.rounds} {mode}: {times[mode][-1]:.3f} s", file=sys.stderr)
    alone, loaded = statistics.median(times["alone"]), statistics.median(times["with_training"])
    result = {"alone_s": round(alone, 3), "with_training_s": round(loaded, 3), "slowdown": round(loaded / alone, 3),
              "rows": args.rows, "chunk_windows": args.chunk_windows, "rounds": args.rounds, "cpu": cpu_model()}
    print(f"cpu: {result['cpu']}\ngenerate alone {alone:.3f} s, with spot training on another core {loaded:.3f} s "
          f"(median of {args.rounds}): {loaded / alone:.3f}x", file=sys.stderr)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
