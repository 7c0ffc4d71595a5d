"""`torchrun --nproc-per-node=2 -m bench.steal --config configs/tiny.yaml --steps 3 --repeats 2 [overrides]`:
the rollout alone, static shards against work stealing and split groups, on the same steps' prompts.

For each of the first N steps of the run's data (the loader's global steps; the policy is the
config's model, not trained), the ranks generate the step's rollouts three ways, interleaved in
turn (ABCDE, then BCDEA, ...) so a drifting machine speed falls on every way alike:

- `static`: each rank its loader shard, all admitted at once (the loop's default);
- `steal`: units (a prompt's n samples) taken as rows free up, each rank's loader shard first,
  then the others' not yet taken (pipeline.rollout.stealing; what long-first has in a run's first epoch:
  no prompt seen yet, every prediction the prior);
- `steal+history`: the same over a plan from each prompt's lengths in an earlier pass (the
  static way's first repeat: a prompt seen in an earlier epoch): a token-balanced deal, longest first;
- `split`: every rank generates its part of every group (rollout.split_groups: rank r of w
  takes samples r*n/w .. (r+1)*n/w - 1 of each prompt);
- `bound`: rank 0 generates the step's longest response alone (by the first pass's lengths), the
  other ranks nothing: no placement of the step's work can end sooner, each response being
  sequential (a lower bound, not a way to run a step).

A way's time is its generation phase: from the barrier before it until the last rank is done.
It prints per way the mean generation phase, its ratio to static (and the ratio of the sums of
each step's fastest repeat: on shared cores contention only adds time), the idle share of rank-seconds
over the phase, and for the stealing ways the idle share until the step's last unit was taken
(pipeline.rollout.schedule.idle_to_last_start); every way's tokens must equal static's (exit 2 if not).
`--json` ends with one line of the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch.distributed as dist

from bench.common import cpu_model, finish
from common.text import load_tokenizer, stop_tokens
from engine.backends.factory import build_rollout_engine
from common.config import load_config
from launch.run.problems import problems_for, prompt_loader
from launch.run.config import TrainConfig
from pipeline.dist import init_ranks, shutdown
from pipeline.rollout.lengths import LengthPredictor
from pipeline.rollout.stage import StepSampling, requests_for
from pipeline.rollout.schedule import idle_to_last_start
from pipeline.shares import split_samples
from pipeline.rollout.stealing import StealingSource, UnitQueue, default_inflight, plan_units

WAYS = ("static", "steal", "steal+history", "split", "bound")


def run_way(way, r, store, key, engine, requests, shard, samples, params, inflight, lengths, longest):
    """One way on this rank: (started, last unit taken or None, ended, {(prompt, sample): tokens});
    `samples`: this rank's part of every group (the split way's); `longest`: the request of the
    step's longest response alone (the bound's)."""
    dist.barrier()
    started = time.time()
    if way in ("static", "split", "bound"):
        if way == "static":
            mine = [requests[i] for i in shard]
        elif way == "split":
            mine = [replace(q, n=len(samples), first_sample=samples.start) for q in requests]
        else:
            mine = [longest] if r.rank == 0 else []
        batch = engine.generate(mine, params) if mine else None
        last = None
    else:
        predicted = [lengths.predict(q.prompt_id) if way == "steal+history" else 1.0 for q in requests]
        plans = plan_units(predicted, requests[0].n, r.world)
        source = StealingSource(UnitQueue(store, key, plans, r.rank), requests, inflight)
        batch = engine.generate([], params, source=source)
        last = source.last_at
    ended = time.time()
    return started, last, ended, {(ro.prompt_id, ro.sample): tuple(ro.tokens) for ro in (batch.rollouts if batch else [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.steal", description=__doc__.splitlines()[1])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args(argv)
    cfg = load_config(TrainConfig, args.config, args.overrides)
    r = init_ranks(cfg.actor.device)
    if r.world < 2:
        print("error: bench.steal compares ways of sharing a step between ranks: run it under torchrun "
              "--nproc-per-node=2", file=sys.stderr)
        return 1
    try:
        samples = split_samples(cfg.rollout.n, r.world, r.rank)  # the split way's part of every group
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    store = dist.distributed_c10d._get_default_store()
    tokenizer = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tokenizer).train
    loader = prompt_loader(cfg, problems, world_size=r.world, rank=r.rank)
    engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed)
    sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tokenizer))
    n, G = cfg.rollout.n, cfg.trainer.prompts_per_step
    shard = list(range(r.rank * G // r.world, (r.rank + 1) * G // r.world))
    inflight = cfg.rollout.steal_inflight or default_inflight(G, n, r.world)
    lengths = LengthPredictor()
    walls = {w: [] for w in WAYS}
    per_step = {w: [[] for _ in range(args.steps)] for w in WAYS}  # generation seconds of each repeat
    idle = {w: [] for w in WAYS}
    before_last = {w: [] for w in WAYS}
    same = True
    for step in range(args.steps):
        requests = requests_for(tokenizer, loader.global_step(), n, cfg.task.chat)
        loader.next_step()
        params = sampling(step)
        reference = longest = None  # set by the first (static) pass
        for rep in range(args.repeats):
            for k in range(len(WAYS)):
                way = WAYS[(k + rep) % len(WAYS)]  # the first pass is static's: the history's and the tokens' reference
                got = run_way(way, r, store, f"bench.steal/{step}/{rep}/{k}", engine, requests, shard, samples,
                              params, inflight, lengths, longest)
                every = [None] * r.world
                dist.all_gather_object(every, got)
                tokens = {key: t for *_, toks in every for key, t in toks.items()}
                if reference is None:
                    reference = tokens
                    for q in requests:
                        lengths.observe(q.prompt_id, [len(reference[(q.prompt_id, s)]) for s in range(n)])
                    pid, sample = max(reference, key=lambda key: len(reference[key]))
                    longest = replace(next(q for q in requests if q.prompt_id == pid), n=1, first_sample=sample)
                same = same and all(reference[key] == t for key, t in tokens.items())
                start, end = min(e[0] for e in every), max(e[2] for e in every)
                walls[way].append(end - start)
                per_step[way][step].append(round(end - start, 3))
                idle[way].append(1 - sum(e[2] - e[0] for e in every) / (r.world * (end - start)))
                if way.startswith("steal"):
                    before_last[way].append(idle_to_last_start([(e[0], e[1], e[2]) for e in every]))
    shutdown()
    if not r.main:
        return 0
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    # Contention only adds time: the sum over steps of each step's fastest repeat is the robust figure on shared cores.
    fastest = {w: sum(min(reps) for reps in per_step[w]) for w in WAYS}
    result = {"cpu": cpu_model(), "world_size": r.world, "steps": args.steps, "repeats": args.repeats,
              "inflight": inflight, "identical": same, "config": args.config, "overrides": args.overrides,
              "ways": {w: {"wall_s": mean(walls[w]), "ratio": mean(walls[w]) / mean(walls["static"]),
                           "idle_share": mean(idle[w]), "idle_to_last_start": mean(before_last[w]), "runs": len(walls[w]),
                           "fastest_s": fastest[w], "fastest_ratio": fastest[w] / fastest["static"],
                           "per_step_s": per_step[w]}
                       for w in WAYS}}
    print(f"cpu: {result['cpu']}; {r.world} ranks; {args.steps} steps x {args.repeats} repeats; in flight {inflight} rows",
          file=sys.stderr)
    for w, v in result["ways"].items():
        extra = "" if v["idle_to_last_start"] is None else f", idle until the last unit started {v['idle_to_last_start']:.3f}"
        print(f"{w:<14} generation {v['wall_s']:.2f} s ({v['ratio']:.3f}x static; fastest repeats {v['fastest_ratio']:.3f}x), "
              f"idle share {v['idle_share']:.3f}{extra}", file=sys.stderr)
    print(f"identical tokens: {same}", file=sys.stderr)
    finish(result, args.json)
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
