"""`python -m bench.longtail --model M --drafter D --requests 64 --n 4 [--json] [--plot F.png]`: a long-tailed rollout, adaptive against fixed.

One generate() call over every request (`--requests` prompts x `--n` samples, all admitted at
once: the batch starts full and thins into the long tail as rollouts finish), T = 1, a fixed
seed, timed end to end for each policy on the same requests:

- autoregressive: an engine without a drafter (the tuner's `off` arm is this run);
- each fixed arm of the tuner's arm set (`--arms`: engine.spec.policy.FixedPolicy with that shape);
- TLT's fixed threshold baseline: the deepest arm once at most `--tail-batch` rows are active
  (engine.spec.policy.TailPolicy);
- adaptive: the BEG-MAB tuner (engine.spec.tuner.TunerPolicy) from scratch, then a second call
  starting from the state the first one saved (state_dict through JSON, as a checkpoint keeps it);
  it explores only arms within `--explore-within` of its bucket's best (a deep draft over 256
  rows costs as much as twenty plain steps: exploring it at random lost more than the tail gains).

With `--repeats R` the whole set of runs goes R times in turn (each round's tuner from scratch,
then from that round's saved state) and each run's time is its median over the rounds: a run of
the tiny model takes well under a second, where one-off noise moves a single ratio by 5-10%.
Every run must produce the same tokens (the bench fails otherwise). Prompts: for a model with a
chat template, test-split prompts of pipeline.tasks.prompts (varied answer lengths); otherwise the
test problems of a tiny model's task (`--task`: mult, the RL run's, with its long-tailed counts;
or arith, with a heavy tail of operand digits, `--max-digits`, `--tail`).
Prints each run's wall time and the ratios adaptive / autoregressive and adaptive / the best
fixed arm in hindsight; the tuner's ceiling with these arms (`per_bucket_best_vs_ar`: each
active-batch bucket at the fastest arm's tokens/s there, an estimate); and each arm's seconds and accept length per active-batch bucket (where
speculation can pay: the share of the time spent in the tail bounds the gain); `--plot` writes a per-step trace of the adaptive runs (active batch size,
chosen arm, tokens/s of the step). `--json` ends with one line `{"adaptive_vs_ar",
"adaptive_vs_best_fixed", "best_fixed", "identical", "cpu", ...}`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from bench.common import batch_list, cpu_model, finish
from common.text import encode, stop_tokens
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.drafter import DraftShape
from engine.spec.drafter_spec import LEARNED
from engine.spec.factory import build_drafter
from engine.spec.policy import FixedPolicy, SpecPolicy, TailPolicy
from engine.spec.tuner import Bandit, TunerPolicy, parse_arm
from engine.types import Request, RolloutBatch, StepRecord


def longtail_prompts(tokenizer, num: int, seed: int, task: str, max_digits: int, tail: float) -> list[list[int]]:
    """Chat models: test-split instruction prompts; otherwise the task's test problems (arith: with
    long-tailed operands, `max_digits` / `tail`; mult: its own long-tailed counts, as the RL run draws them)."""
    if getattr(tokenizer, "chat_template", None):
        from pipeline.tasks.prompts import make_prompts

        return [encode(tokenizer, row["prompt"], True) for row in make_prompts(num, seed, "test")]
    from pipeline.tasks import arith, get_task

    if task == "arith":
        problems = arith.make_problems("test", num, seed, max_digits=max_digits, tail=tail)
    else:
        problems = get_task(task).make_problems("test", num, seed)
    return [tokenizer(p.prompt)["input_ids"] for p in problems]


def limits_of(arms: list[DraftShape | None]) -> tuple[int, int, int]:
    """The engine's maximum sizes (depth, topk, verify_tokens) that every arm fits in."""
    shapes = [a for a in arms if a is not None]
    if not shapes:
        raise ValueError("--arms needs at least one draft shape besides 'off', e.g. off,d4k1v4,d16k1v16")
    return tuple(max(getattr(s, k) for s in shapes) for k in ("depth", "topk", "verify_tokens"))  # type: ignore[return-value]


def timed_rollout(engine: RolloutEngine, policy: SpecPolicy, requests: list[Request], params: SamplingParams) -> tuple[RolloutBatch, float]:
    engine.policy = policy
    t = time.perf_counter()
    out = engine.generate(requests, params)
    return out, time.perf_counter() - t


def step_tokens_per_s(r: StepRecord) -> float:
    return sum(r.emitted) / r.seconds if r.seconds > 0 else 0.0


def tuner_medians(policy: TunerPolicy, labels: list[str]) -> dict[str, dict[str, float]]:
    """bucket -> arm -> median reward (tokens/s) in the tuner's window: what it learned."""
    out = {}
    for i, arms in enumerate(policy.bandit.rewards):
        row = {labels[a]: round(statistics.median(r), 1) for a, r in enumerate(arms) if r}
        if row:
            out[str(policy.bandit.thresholds[i])] = row
    return out


def draft_after_switch(runs: list[RolloutBatch]) -> dict[str, float]:
    """Median draft seconds per row of speculative steps right after an `off` step (the drafter
    catches up on what it took in while off) and after a speculative one."""
    after = {"after_off": [], "after_spec": []}
    for run in runs:
        for prev, r in zip(run.steps, run.steps[1:]):
            if r.speculative:
                after["after_spec" if prev.speculative else "after_off"].append(r.draft_s / r.batch_size)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in after.items() if v}


def by_batch(steps: list[StepRecord], thresholds: list[int]) -> dict[str, dict[str, float]]:
    """Per batch-size bucket ("1", "2-4", ..., "21+"): seconds spent and accept length (tokens emitted per row per step)."""
    out: dict[str, dict[str, float]] = {}
    for i, lo in enumerate(thresholds):
        hi = thresholds[i + 1] - 1 if i + 1 < len(thresholds) else None
        sel = [r for r in steps if r.batch_size >= lo and (hi is None or r.batch_size <= hi)]
        if sel:
            name = str(lo) if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}"
            out[name] = {"s": round(sum(r.seconds for r in sel), 3),
                         "accept_len": round(sum(sum(r.emitted) for r in sel) / sum(r.batch_size for r in sel), 2)}
    return out


def per_bucket_best(runs: dict[str, RolloutBatch], labels: list[str], bandit: Bandit, wall_ar: float) -> tuple[float, dict[str, str]]:
    """The tuner's ceiling with these arms: seconds of a policy that ran each of the tuner's
    active-batch buckets (the bandit's own) at the fastest fixed arm's tokens/s there (autoregressive
    included, whether or not `--arms` names off), and that arm per bucket's threshold.

    An estimate, not a run: a bucket's tokens are the autoregressive run's (every arm emits the same
    tokens, and rows leave the batch at the same lengths, so the tokens emitted while 2-4 rows are
    active barely depend on the arm); the time outside decode steps (prefill) is the autoregressive
    run's. The tuner can beat it only by noise or by a bucket's mix of arms."""
    def buckets(steps: list[StepRecord]) -> list[tuple[int, float]]:  # per bucket: (tokens, seconds)
        out = [(0, 0.0)] * len(bandit.thresholds)
        for r in steps:
            i = bandit.bucket(r.batch_size)
            out[i] = (out[i][0] + sum(r.emitted), out[i][1] + r.seconds)
        return out

    per_arm = {k: buckets(runs[k].steps) for k in dict.fromkeys(["off", *labels])}  # the autoregressive run is always there
    ar = per_arm["off"]
    total = wall_ar - sum(s for _, s in ar)
    chosen = {}
    for i, (tokens, _) in enumerate(ar):
        if tokens == 0:
            continue
        rates = {k: b[i][0] / b[i][1] for k, b in per_arm.items() if b[i][1] > 0}
        fastest = max(rates, key=rates.get)
        chosen[str(bandit.thresholds[i])] = fastest
        total += tokens / rates[fastest]
    return total, chosen


def plot_trace(path: str, traces: dict[str, list[StepRecord]], labels: list[str]) -> None:
    """Three panels over decode steps: active rows, the arm chosen, emitted tokens per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for name, steps in traces.items():
        x = [r.index for r in steps]
        axes[0].plot(x, [r.batch_size for r in steps], label=name)
        axes[1].plot(x, [labels.index(r.shape) if r.shape in labels else -1 for r in steps], ".", ms=3, label=name)
        axes[2].plot(x, [step_tokens_per_s(r) for r in steps], lw=0.8, label=name)
    axes[0].set_ylabel("active rows")
    axes[0].set_yscale("log", base=2)
    axes[1].set_yticks(range(len(labels)), labels)
    axes[1].set_ylabel("arm")
    axes[2].set_ylabel("tokens / s (step)")
    axes[2].set_xlabel("decode step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.longtail", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True, help="drafter folder (eagle / eagle3 / mtp)")
    p.add_argument("--spec", default="eagle", choices=LEARNED)
    p.add_argument("--drafter-products", default="auto", choices=("float32", "bf16", "auto"),
                   help="the drafter's kernel products (engine.spec.drafter_products; auto, as configs/tiny.yaml ships)")
    p.add_argument("--products", default="float32", choices=("float32", "bf16", "auto"),
                   help="the target's kernel products, on both sides (engine.products; float32, as configs/tiny.yaml ships)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per request")
    p.add_argument("--arms", default="off,d4k1v4,d8k1v8,d16k1v16", help="the tuner's arm set, comma-separated")
    p.add_argument("--buckets", type=batch_list, default="1,2,5,21", help="the tuner's batch-size thresholds")
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--explore-within", type=float, default=0.8,
                   help="the tuner explores only arms whose median reward is >= this x the bucket's best (0: all; "
                        "engine.spec.tuner_explore_within)")
    p.add_argument("--tail-batch", type=int, default=32, help="TLT baseline: speculate once at most this many rows are active")
    p.add_argument("--task", default="mult", choices=("mult", "arith"), help="the prompts of a tiny model's task")
    p.add_argument("--new-tokens", type=int, default=896)
    p.add_argument("--max-digits", type=int, default=18, help="arith prompts: the longest operand")
    p.add_argument("--tail", type=float, default=0.5, help="arith prompts: P(digits d) ~ d^-tail")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling noise")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--plot", default=None, help="PNG for the per-step trace of the adaptive runs")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every run; each run's time is its median")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    try:
        labels = [a.strip() for a in args.arms.split(",") if a.strip()]
        arms = [parse_arm(a) for a in labels]
        depth, topk, verify = limits_of(arms)
        if args.requests < 1 or args.n < 1:
            raise ValueError("--requests and --n must be >= 1")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        target = load_checkpoint(args.model, device=args.device)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = longtail_prompts(tokenizer, args.requests, args.seed, args.task, args.max_digits, args.tail)
        rows = args.requests * args.n
        # Caches sized for the longest prompt and its response, no more (SmolLM2's 2048 positions x 256
        # rows would be ~24 GB per engine).
        max_len = min(2048, target.config.max_position_embeddings,
                      max(map(len, prompts)) + args.new_tokens + verify + depth * topk + 2)
        spec = SpecConfig(enabled=True, drafter=args.spec, drafter_path=args.drafter, depth=depth, topk=topk, verify_tokens=verify,
                          drafter_products=args.drafter_products)
        engine_cfg = dict(max_batch=rows, max_len=max_len, device=args.device, products=args.products)
        ar = RolloutEngine(copy.deepcopy(target), EngineConfig(**engine_cfg))  # each runtime packs its own model
        sp = RolloutEngine(target, EngineConfig(**engine_cfg, spec=spec), build_drafter(spec, target))
        TunerPolicy(arms, args.buckets, epsilon=args.epsilon, explore_within=args.explore_within)  # validates buckets and epsilon before any run
    except (OSError, ValueError) as e:  # a missing folder or file, a bad flag
        print(f"error: {e}", file=sys.stderr)
        return 1
    stops = stop_tokens(target.config, tokenizer)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed, stop_token_ids=stops)
    requests = [Request(prompt_id=f"longtail-{i}", prompt=x, n=args.n) for i, x in enumerate(prompts)]

    # First calls pay one-time costs (allocation, kernel loading) per engine and draft shape: not timed.
    warm = [Request(prompt_id="warm-up", prompt=prompts[0], n=2)]
    warm_params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=stops)
    ar.generate(warm, warm_params)
    for arm in arms:
        if arm is not None:
            timed_rollout(sp, FixedPolicy(arm), warm, warm_params)

    deepest = max((a for a in arms if a is not None), key=lambda a: (a.depth * a.topk, a.verify_tokens))
    rounds: list[dict[str, float]] = []  # per round: run -> seconds
    identical = True
    for _ in range(args.repeats):
        seconds, runs = {}, {}
        t = time.perf_counter()
        runs["off"] = ar.generate(requests, params)
        seconds["off"] = time.perf_counter() - t
        for label, arm in zip(labels, arms):
            if arm is not None:
                runs[label], seconds[label] = timed_rollout(sp, FixedPolicy(arm), requests, params)
        runs["tail"], seconds["tail"] = timed_rollout(sp, TailPolicy(deepest, args.tail_batch), requests, params)
        scratch = TunerPolicy(arms, args.buckets, epsilon=args.epsilon, seed=args.seed, explore_within=args.explore_within)
        runs["adaptive_scratch"], seconds["adaptive_scratch"] = timed_rollout(sp, scratch, requests, params)
        warm_tuner = TunerPolicy(arms, args.buckets, epsilon=args.epsilon, seed=args.seed + 1, explore_within=args.explore_within)
        warm_tuner.load_state_dict(json.loads(json.dumps(scratch.state_dict())))  # as a checkpoint carries it
        runs["adaptive"], seconds["adaptive"] = timed_rollout(sp, warm_tuner, requests, params)
        ref = runs["off"]
        identical = identical and all([a.tokens for a in out] == [a.tokens for a in ref] for out in runs.values())
        seconds["per_bucket_best"], per_bucket_arms = per_bucket_best(runs, labels, warm_tuner.bandit, seconds["off"])
        rounds.append(seconds)
    seconds = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    t_ar = seconds["off"]
    best = min(labels, key=lambda k: seconds[k])  # the fixed arms, off (autoregressive) included
    ceiling = seconds.pop("per_bucket_best")
    tokens = sum(len(r.tokens) for r in ref)
    lengths = sorted(len(r.tokens) for r in ref)
    result = {
        "adaptive_vs_ar": round(t_ar / seconds["adaptive"], 3),
        "adaptive_vs_best_fixed": round(seconds[best] / seconds["adaptive"], 3),
        "scratch_vs_ar": round(t_ar / seconds["adaptive_scratch"], 3),
        "scratch_vs_best_fixed": round(seconds[best] / seconds["adaptive_scratch"], 3),
        "tail_vs_ar": round(t_ar / seconds["tail"], 3),
        "per_bucket_best_vs_ar": round(t_ar / ceiling, 3), "adaptive_vs_per_bucket_best": round(ceiling / seconds["adaptive"], 3),
        "per_bucket_best_arms": per_bucket_arms,
        "best_fixed": best, "identical": identical, "seconds": {k: round(v, 6) for k, v in seconds.items()},
        "accept_len": {k: round(v.stats.accept_len, 3) for k, v in runs.items() if k != "off"},
        "decode_steps": {k: len(v.steps) for k, v in runs.items()},
        "rollouts": len(ref), "tokens": tokens,
        "length_p50_p90_max": [lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.9)], lengths[-1]],
        "arms": labels, "buckets": args.buckets, "tail_batch": args.tail_batch, "tuner_metrics": warm_tuner.metrics(),
        "tuner_medians": tuner_medians(warm_tuner, labels),
        "draft_ms_per_row": draft_after_switch([runs["tail"], runs["adaptive_scratch"], runs["adaptive"]]),
        "explore_within": args.explore_within, "drafter_products": args.drafter_products,
        "products": args.products, "repeats": args.repeats,
        "adaptive_vs_ar_by_round": [round(r["off"] / r["adaptive"], 3) for r in rounds],
        "by_batch": {k: by_batch(runs[k].steps, [1, 2, 5, 21, 65]) for k in labels},
    }
    print(f"cpu: {cpu_model()}; target products {'bf16' if ar.runtime.bf16_products else 'float32'}; {len(ref)} rollouts, "
          f"{tokens} tokens, lengths p50/p90/max {result['length_p50_p90_max']}"
          + (f"; medians of {args.repeats} rounds (adaptive vs ar by round: {result['adaptive_vs_ar_by_round']})"
             if args.repeats > 1 else ""), file=sys.stderr)
    print(f"{'run':>18} {'wall s':>8} {'vs ar':>6} {'steps':>6} {'accept len':>10}", file=sys.stderr)
    for k, v in seconds.items():
        acc = result["accept_len"].get(k, 1.0)
        print(f"{k:>18} {v:>8.2f} {t_ar / v:>6.2f} {len(runs[k].steps):>6} {acc:>10.2f}", file=sys.stderr)
    print(f"adaptive {result['adaptive_vs_ar']:.2f}x autoregressive, {result['adaptive_vs_best_fixed']:.2f}x the best fixed arm "
          f"({best}); from scratch {result['scratch_vs_ar']:.2f}x / {result['scratch_vs_best_fixed']:.2f}x; "
          f"identical tokens: {identical}", file=sys.stderr)
    print(f"the fastest arm per active-batch bucket in hindsight (an estimate, {per_bucket_arms}): "
          f"{result['per_bucket_best_vs_ar']:.2f}x autoregressive, the tuner's ceiling with these arms; "
          f"the tuner reached {result['adaptive_vs_per_bucket_best']:.2f}x of it", file=sys.stderr)
    print(f"tuner's median reward (tokens/s) per bucket and arm: {result['tuner_medians']}", file=sys.stderr)
    for k, buckets in result["by_batch"].items():
        print(f"{k:>18} by active batch: " + ", ".join(f"{b}: {v['s']:.2f} s, accept {v['accept_len']:.2f}" for b, v in buckets.items()),
              file=sys.stderr)
    print(f"draft ms per row, speculative steps after an off step / after a speculative one: {result['draft_ms_per_row']}",
          file=sys.stderr)
    if args.plot:
        plot_trace(args.plot, {"adaptive (saved state)": runs["adaptive"].steps, "adaptive (scratch)": runs["adaptive_scratch"].steps},
                   labels)
        print(f"trace: {args.plot}", file=sys.stderr)
    finish(result, args.json)
    return 0 if identical else 2


if __name__ == "__main__":
    sys.exit(main())
