"""`python -m bench.bubble --config configs/tiny.yaml [--lrs 3e-5,1e-4,3e-4,1e-3] [--plot F.png] [--json]`:
bubble drafts at step t+1, pre-generated with policy t.

(With `--steps N` under `torchrun --nproc-per-node=2` it runs N whole RL steps with and without
bubble drafts instead, covering what the idle windows really pre-generate: bench.bubble_run.)

For each actor learning rate: step t+1's prompts (the data loader's next shard) are rolled out
with policy t and step t+1's sampling params (what an idle rank pre-generates); then one real RL
step (pipeline.trainer: rollouts, GRPO update, weight sync) makes policy t+1; then step t+1's
requests are generated three ways with policy t+1, all asserted to give identical tokens:

- autoregressive (speculation off);
- the config's drafter (EAGLE, no bubble drafts);
- bubble drafts first (`pregenerated+<drafter>`), falling back to the drafter where a draft runs out.

Speculating ways follow the config's speculation policy (`engine.spec.max_active_batch`: only in
the tail; `engine.spec.max_active_batch=null`: every step). Every row is covered (the bench pre-generates the whole shard; how much of a step the idle
windows cover in a real run is `bubble/coverage` in the run's metrics). Prints, per learning
rate, target forward passes (decode steps), wall time and accept length of each way, and the
ratios bubble / autoregressive. `--plot` draws accept length against the learning rate. The
first learning rate is the headline; `--json` ends with `{"decode_steps_ratio",
"rollout_ratio", "coverage", "accept_len_covered", "identical", "sweep": [...], "cpu"}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import cpu_model, finish, save_plot
from common.text import load_tokenizer, pad_token, stop_tokens
from engine.engine import RolloutEngine
from engine.spec.factory import build_drafter
from engine.types import Request
from common.config import load_config
from launch.run.config import TrainConfig
from launch.run.problems import problems_for, prompt_loader
from pipeline.actors import build_actor
from pipeline.algorithms import build_algorithm
from pipeline.dist import Ranks, run_scope
from pipeline.update.learner import Learner, uses_engine_logprobs
from pipeline.rollout.stage import StepSampling, encode_problem
from pipeline.tasks.reward_scoring import build_rewards
from pipeline.trainer import Trainer


def by_key(batch) -> dict[tuple[str, int], list[int]]:
    return {(r.prompt_id, r.sample): r.tokens for r in batch}


def timed_generate(engine, requests, params):
    t = time.perf_counter()
    batch = engine.generate(requests, params)
    return batch, time.perf_counter() - t


def one_lr(cfg: TrainConfig, lr: float, out: Path, batch1: int = 0) -> dict:
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, lr=lr))
    tok = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tok)
    task, train_problems = problems.task, problems.train
    loader = prompt_loader(cfg, train_problems)
    base = cfg.engine.spec.drafter
    bubble_cfg = dataclasses.replace(cfg.engine, spec=dataclasses.replace(cfg.engine.spec, drafter=f"pregenerated+{base}"))
    engine = RolloutEngine.from_pretrained(cfg.model.path, bubble_cfg)
    actor = build_actor(cfg.actor, cfg.model.path)
    engine.load_weights(actor.named_weights(), version=0)
    sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tok))
    learner = Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, Ranks(), actor,
                      pad_token(tok), uses_engine_logprobs(cfg.trainer, sampling.is_policy, engine.caps.exact_logprobs))
    trainer = Trainer(cfg.trainer, cfg.rollout, cfg.task, Ranks(), engine, learner, tok, build_rewards(cfg.task, task),
                      loader, [], sampling, out, scope=run_scope(out))

    upcoming = loader.peek(2)  # step t+1's shard (step t is the next one the loader hands out)

    def requests(drafts=None):
        return [Request(prompt_id=p.id, prompt=encode_problem(tok, p, cfg.task.chat), n=cfg.rollout.n,
                        drafts=(drafts or {}).get(p.id)) for p in upcoming]

    t = 0
    pre = by_key(engine.generate(requests(), trainer.sampling(t + 1)))  # policy t, step t+1's noise
    trainer.step()  # step t: rollouts, update, sync -> policy t+1
    params = trainer.sampling(t + 1)
    drafts: dict[str, dict[int, list[int]]] = {}
    for (pid, s), tokens in pre.items():
        drafts.setdefault(pid, {})[s] = tokens
    ar = RolloutEngine(engine.model, dataclasses.replace(cfg.engine, spec=dataclasses.replace(cfg.engine.spec, enabled=False)))
    ways = {}
    ways["autoregressive"] = timed_generate(ar, requests(), params)
    # Fresh drafters for every way: an n-gram drafter remembers a step's finished responses across
    # calls, and those are the very rollouts measured here.
    engine.attach_drafter(build_drafter(bubble_cfg.spec, engine.model).drafters[-1])  # the config's drafter alone
    ways["drafter"] = timed_generate(engine, requests(), params)
    engine.attach_drafter(build_drafter(bubble_cfg.spec, engine.model))
    ways["bubble"] = timed_generate(engine, requests(drafts), params)
    ref = by_key(ways["autoregressive"][0])
    identical = all(by_key(b) == ref for b, _ in ways.values())
    if batch1:  # the same rows one at a time (sample 0 of the first prompts): where a CPU decode step is cheapest
        solo = {}
        for name in ("autoregressive", "drafter", "bubble"):
            fresh = build_drafter(bubble_cfg.spec, engine.model)
            engine.attach_drafter(fresh.drafters[-1] if name == "drafter" else fresh)
            steps = wall = accepted = drafted = 0
            for req in requests(drafts)[:batch1]:
                one = Request(prompt_id=req.prompt_id, prompt=req.prompt, n=1,
                              drafts={0: drafts[req.prompt_id][0]} if name == "bubble" else None)
                b, w = timed_generate(ar if name == "autoregressive" else engine, [one], params)
                identical &= b.rollouts[0].tokens == ref[(req.prompt_id, 0)]
                steps, wall = steps + len(b.steps), wall + w
                accepted, drafted = accepted + b.stats.accepted, drafted + b.stats.speculative_steps
            solo[name] = {"decode_steps": steps, "wall_s": round(wall, 3),
                          "accept_len": round(1 + accepted / drafted, 3) if drafted else 1.0}
    row = {"lr": lr, "identical": identical, "policy_changed_tokens": sum(ref[k] != pre[k] for k in ref) / len(ref)}
    for name, (batch, wall) in ways.items():
        row[name] = {"decode_steps": len(batch.steps), "wall_s": round(wall, 3), "accept_len": round(batch.stats.accept_len, 3)}
    row["decode_steps_ratio"] = round(row["bubble"]["decode_steps"] / row["autoregressive"]["decode_steps"], 3)
    row["rollout_ratio"] = round(row["autoregressive"]["wall_s"] / row["bubble"]["wall_s"], 3)
    row["vs_drafter"] = round(row["drafter"]["wall_s"] / row["bubble"]["wall_s"], 3)
    if batch1:
        row["batch1"] = solo | {"rows": batch1,
                                "rollout_ratio": round(solo["autoregressive"]["wall_s"] / solo["bubble"]["wall_s"], 3),
                                "vs_drafter": round(solo["drafter"]["wall_s"] / solo["bubble"]["wall_s"], 3)}
    return row


def plot(path: Path, sweep: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = [r["lr"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(lrs, [r["bubble"]["accept_len"] for r in sweep], "o-", label="bubble drafts (policy t)")
    ax.plot(lrs, [r["drafter"]["accept_len"] for r in sweep], "s--", label="EAGLE drafter")
    ax.set_xscale("log")
    ax.set_xlabel("actor learning rate (one update between pre-generation and use)")
    ax.set_ylabel("accept length at step t+1")
    save_plot(fig, ax, path, title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bubble", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--lrs", default=None, help="actor learning rates, comma-separated (default: the config's)")
    p.add_argument("--plot", default=None)
    p.add_argument("--batch1", type=int, default=0, help="also time the first K prompts' sample 0 one at a time (batch 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="instead: N RL steps with and without bubble drafts under torchrun (bench.bubble_run)")
    p.add_argument("--out", default=None, help="with --steps: folder for the runs (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args(argv)
    if args.steps is not None:
        from bench.bubble_run import run_steps

        return run_steps(args.config, args.steps, args.overrides, args.out, args.json)
    common = ["metrics.wandb=false", "metrics.console=false", "metrics.dashboard=false", "spot.enabled=false",
              "bubble.enabled=false", "trainer.async_steps=0", *args.overrides]
    try:
        cfg = load_config(TrainConfig, args.config, common)
        if not cfg.engine.spec.enabled or cfg.engine.spec.drafter_spec.composed:
            raise ValueError("bench.bubble needs engine.spec.enabled=true with a single drafter (eagle, eagle3 or ngram)")
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else [cfg.actor.lr]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    torch.set_num_threads(torch.get_num_threads())
    out = Path(tempfile.mkdtemp(prefix="tailspec-bubble-"))
    sweep = [one_lr(cfg, lr, out / f"lr{lr:g}", args.batch1) for lr in lrs]
    head = sweep[0]
    print(f"cpu: {cpu_model()}", file=sys.stderr)
    print(f"{'lr':>8} {'way':>15} {'decode steps':>13} {'wall s':>8} {'accept':>7}", file=sys.stderr)
    for r in sweep:
        for way in ("autoregressive", "drafter", "bubble"):
            print(f"{r['lr']:>8.0e} {way:>15} {r[way]['decode_steps']:>13} {r[way]['wall_s']:>8.2f} {r[way]['accept_len']:>7.2f}",
                  file=sys.stderr)
        print(f"{'':>8} bubble / AR decode steps {r['decode_steps_ratio']:.2f}, rollout speed-up {r['rollout_ratio']:.2f}x "
              f"(vs the drafter alone {r['vs_drafter']:.2f}x); {r['policy_changed_tokens']:.0%} of responses changed by the "
              f"update; identical: {r['identical']}", file=sys.stderr)
        if "batch1" in r:
            b1 = r["batch1"]
            print(f"{'':>8} batch 1 ({b1['rows']} rows one at a time): decode steps AR {b1['autoregressive']['decode_steps']}, "
                  f"drafter {b1['drafter']['decode_steps']}, bubble {b1['bubble']['decode_steps']}; bubble {b1['rollout_ratio']:.2f}x "
                  f"autoregressive, {b1['vs_drafter']:.2f}x the drafter; accept {b1['bubble']['accept_len']:.2f}", file=sys.stderr)
    result = {"decode_steps_ratio": head["decode_steps_ratio"], "rollout_ratio": head["rollout_ratio"], "coverage": 1.0,
              "accept_len_covered": head["bubble"]["accept_len"], "identical": all(r["identical"] for r in sweep),
              "sweep": sweep, "config": args.config, "overrides": args.overrides, "cpu": cpu_model()}
    if args.plot:
        plot(Path(args.plot), sweep, f"{args.config} {' '.join(args.overrides)}\n{result['cpu']}")
        print(f"wrote {args.plot}", file=sys.stderr)
    finish(result, args.json)
    return 0 if result["identical"] else 2


if __name__ == "__main__":
    sys.exit(main())
