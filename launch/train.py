"""`python -m launch.train --config configs/tiny.yaml [section.key=value ...]`: the main CPU job.

For now (before the RL loop lands): load the policy, report its greedy held-out accuracy on the
task, then run one step's rollouts (n samples per prompt) through the engine and report their
rewards, lengths and throughput. The resolved config, the rollouts and a summary are saved in
runs/<name>-<timestamp>/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.types import Request
from launch.config import load_config, override_args, save_config
from launch.run_config import TrainConfig
from pipeline.tasks import get_task


def percentile(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(cfg: TrainConfig, out: Path) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.run.seed)
    task = get_task(cfg.task.name)
    engine = RolloutEngine.from_pretrained(cfg.model.path, cfg.engine)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    stops = tuple(engine.model.config.eos_ids) or (tok.eos_token_id,)

    def requests(problems, n):
        return [Request(prompt_id=p.id, prompt=tok(p.prompt)["input_ids"], n=n) for p in problems]

    held_out = task.make_problems("test", cfg.task.eval_problems, cfg.task.seed)
    greedy = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, stop_token_ids=stops)
    t0 = time.perf_counter()
    texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in engine.generate(requests(held_out, 1), greedy)]
    accuracy = sum(task.reward(t, p.answer) for t, p in zip(texts, held_out)) / len(held_out)
    print(f"held-out greedy accuracy: {accuracy:.1%} on {len(held_out)} problems ({time.perf_counter() - t0:.1f}s)")

    prompts = task.make_problems("train", cfg.task.prompts, cfg.task.seed)
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            seed=cfg.run.seed, step=0, stop_token_ids=stops)
    rollouts = engine.generate(requests(prompts, r.n), params)
    s = engine.last_stats
    answers = {p.id: p.answer for p in prompts}
    rewards = [task.reward(tok.decode(ro.tokens, skip_special_tokens=True), answers[ro.prompt_id]) for ro in rollouts]
    lengths = [len(ro.tokens) for ro in rollouts]
    with (out / "rollouts.jsonl").open("w") as f:
        for ro, rew in zip(rollouts, rewards):
            f.write(json.dumps({"id": ro.prompt_id, "sample": ro.sample, "tokens": ro.tokens, "reward": rew,
                                "finish_reason": ro.finish_reason}) + "\n")
    summary = {
        "heldout_accuracy": accuracy, "rollouts": len(rollouts), "reward_mean": statistics.mean(rewards),
        "length_p50": percentile(lengths, 0.5), "length_p90": percentile(lengths, 0.9), "length_max": max(lengths),
        "tokens": s.new_tokens, "seconds": round(s.wall_s, 3), "tokens_per_s": round(s.tokens_per_s, 1),
        "decode_steps": len(s.batch_sizes), "accept_len": round(s.accept_len, 3),
    }
    # The long tail: how many decode steps ran with most of the batch already finished.
    full = max(s.batch_sizes) if s.batch_sizes else 0
    tail = sum(1 for b in s.batch_sizes if b <= full // 4)
    print(
        f"rollouts: {len(rollouts)} ({cfg.task.prompts} prompts x {r.n}), reward {summary['reward_mean']:.2f}, "
        f"length p50 {summary['length_p50']} / p90 {summary['length_p90']} / max {summary['length_max']} tokens, "
        f"{s.new_tokens} tokens in {s.wall_s:.1f}s = {s.tokens_per_s:.0f} tok/s; "
        f"{tail}/{len(s.batch_sizes)} decode steps ran with <= 1/4 of the batch (the long tail)"
    )
    if engine.drafter is not None:
        print(f"speculation ({engine.drafter.name}): accept length {s.accept_len:.2f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.splitlines()[0],
                                     epilog="Any section.key=value argument overrides the config file.")
    parser.add_argument("--config", default="configs/tiny.yaml")
    args = parser.parse_args(rest)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
        out = Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        print(f"run {out} (config saved)")
        run(cfg, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
