"""`python -m bench.e2e --config configs/tiny.yaml --steps N [--levers spec,tuner,...] [--repeats K] [--plot F.png] [--json]`:
the product's headline: the same RL steps with every lever off, as shipped, and with each lever alone.

Runs the same N RL steps (same seeds, same data) several ways in this process group, one after
another (bench.runs), `--repeats K` rounds of them (every way once a round; the times are pooled
over rounds and the step ratio of each round is printed too, so a machine whose speed drifts
over the bench shows it):

- all-off: autoregressive rollouts, no spot training, no bubble drafts, each rank rolling out
  the whole groups of its loader shard (ALL_OFF);
- as-shipped: the config as given;
- each lever added alone to all-off (`levers`, chosen with `--levers`): `spec`, the config's
  drafter with its fixed shape (depth, top-k, verify tokens, max_active_batch; no tuner); `tuner`,
  the BEG-MAB tuner over the config's arms (a default arm set where the config has none, said
  with the table); `spot`, the config's speculation plus spot training; `bubble`, the config's
  speculation behind bubble drafts (`pregenerated+<drafter>`); `steal`, work stealing with
  long-first order (rollout.work_stealing, rollout.long_first: ranks take prompt groups from one
  queue, predicted-long first); `split`, every rank generating its part of every group
  (rollout.split_groups); `long_first`, static shards admitted predicted-long first. A lever the
  config does not turn on is measured all the same, unless it cannot run here (spot needs a
  learned drafter; spot, bubble, steal and split need two or more ranks): then it is skipped and
  the reason printed.

No lever changes a token, so every way must be the same run as all-off: each step's reward,
losses, grad norm and response length, and the final weights (bench.runs.same_steps,
same_weights). Over steps 2..N (step 1 pays one-time costs), it prints the CPU model, a table per
way (step, rollout, update and idle seconds, accept length, step ratio against all-off,
identical), then:

- the step ratio all-off / as-shipped (the mean, and the worst step's beside it) and the rollout ratio (of the generation phase: rollouts
  until every rank is done, rollout + idle);
- R_gen, the generation phase's share of all-off's step, and its idle share (the other ranks'
  wait: the bubble spot training and bubble drafts fill);
- alpha, as-shipped's accept length, and the ceiling 1 / (R_gen / alpha + 1 - R_gen)
  (NeMo-RL's step bound: speculation free, verification as cheap as decoding), with the step
  ratio as a share of it; and the same bound at the generation phase's measured ratio in place of
  alpha (`rollout_bound`): the step ratio if the rest of the step kept its time. The first gap is
  what drafting and verifying cost on the device; the second what the step around the rollout
  adds or, with idle work, takes away;
- each lever's contribution: its step ratio against all-off.

`--plot` draws each step's time split (rollout, idle, log-probs, update, sync), all-off beside
as-shipped. `--json` ends with one line `{"step_ratio", "rollout_ratio", "r_gen", "accept_len",
"ceiling", "rollout_bound", "identical", "idle_share", "update_skipped_share", "levers": {name: {"step_ratio", "rollout_ratio",
"accept_len", "identical"}}, "cpu", ...}`. Exits 0 when every way was identical to all-off, 2
when one was not, 1 on bad input.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.common import cpu_model, finish, save_plot
from bench.runs import bench_overrides, mean, plan_config, read_metrics, same_steps, same_weights, train_runs
from engine.spec.drafter import DraftShape
from common.config import load_config
from launch.run.config import TrainConfig

ALL_OFF = ("engine.spec.enabled=false", "spot.enabled=false", "bubble.enabled=false", "rollout.work_stealing=false",
           "rollout.split_groups=false", "rollout.long_first=false")
LEVERS = ("spec", "tuner", "spot", "bubble", "steal", "split", "long_first", "history", "das")
PARTS = ("rollout", "idle", "logprob", "update", "sync")  # a step's phases, in order (timing/<part>)


@dataclass(frozen=True)
class Lever:
    """One lever added alone to all-off: its overrides (after ALL_OFF), a note said with the table,
    and why it cannot run here (None: it runs)."""

    name: str
    overrides: tuple[str, ...]
    note: str = ""
    skip: str | None = None


def default_arms(shape: DraftShape) -> list[str]:
    """'off', then the shape at a quarter, half and full depth and verify tokens (deduplicated)."""
    arms = ["off"]
    for div in (4, 2, 1):
        label = DraftShape(depth=max(1, shape.depth // div), topk=shape.topk,
                           verify_tokens=max(1, shape.verify_tokens // div)).label
        if label not in arms:
            arms.append(label)
    return arms


def length_aware_arms(arms: list[str], top: int) -> list[str]:
    """The arms, then a variant of each chain arm shallower than `top` that drafts long rows `top` deep."""
    from engine.spec.tuner import parse_arm

    extra = []
    for label in arms:
        arm = parse_arm(label)
        if arm is not None and arm.topk == 1 and not arm.long_depth and arm.chain_len < top:
            extra.append(DraftShape(depth=arm.depth, topk=1, verify_tokens=arm.verify_tokens, long_depth=top,
                                    min_confidence=arm.min_confidence).label)
    return [*arms, *(a for a in extra if a not in arms)]


def recurrence_note(cfg: TrainConfig) -> str:
    """When the run's prompts first recur (history drafts need them to)."""
    per_step, problems = cfg.trainer.prompts_per_step, cfg.task.train_problems
    first = -(-problems // per_step) + 1 if not cfg.task.file else None
    if first is None:
        return "history drafts pay once prompts recur (a second epoch of task.file)"
    return f"prompts recur from step {first} ({problems} problems, {per_step} a step); earlier steps draft from siblings only"


def levers(cfg: TrainConfig, world: int) -> list[Lever]:
    """The levers of the config `cfg` (as shipped) on `world` ranks, in LEVERS' order. Each turns
    speculation on with the config's drafter less any bubble part; the rest of engine.spec is
    the config's unless the lever is that setting."""
    spec = cfg.engine.spec
    drafter = "+".join(p for p in spec.drafter_spec.parts if p != "pregenerated")
    history = "+".join(["history", *(p for p in spec.drafter_spec.parts if p not in ("pregenerated", "history"))])
    arms, note = spec.tuner_arms, ""
    if not arms:
        arms = default_arms(DraftShape(depth=spec.depth, topk=spec.topk, verify_tokens=spec.verify_tokens))
        note = f"the config has no tuner arms: the default set {','.join(arms)} (its shape, half and quarter)"
    idle = None if world > 1 else "needs idle windows, so two or more ranks: run under torchrun --nproc-per-node=2"
    ranks = None if world > 1 else "steals work between ranks, so two or more ranks: run under torchrun --nproc-per-node=2"
    split = None if world > 1 else "splits groups between ranks, so two or more ranks: run under torchrun --nproc-per-node=2"
    learned = (None if spec.drafter_spec.learned
               else f"spot training trains a learned drafter; engine.spec.drafter={drafter} has none")
    on = lambda d: ("engine.spec.enabled=true", f"engine.spec.drafter={d}")  # noqa: E731
    top = spec.max_chain_len
    # The length-aware budget on the config's speculation: a variant of each tuner arm, or the fixed shape's.
    budget = ((f"engine.spec.tuner_arms={json.dumps(length_aware_arms(spec.tuner_arms, top))}", "engine.spec.max_active_batch=null")
              if spec.tuner_arms else ("engine.spec.tuner_arms=[]", f"engine.spec.long_depth={top}"))
    shallow = (length_aware_arms(spec.tuner_arms, top) != spec.tuner_arms if spec.tuner_arms
               else spec.topk == 1 and spec.chain_len < top)
    deepest = None if shallow else (f"every arm already drafts to the engine's maximum depth {top} (engine.spec.max_depth, "
                                    "max_verify_tokens), or none is a chain: nothing to budget")
    return [
        Lever("spec", (*on(drafter), "engine.spec.tuner_arms=[]")),
        # The tuner decides when to speculate ("off" is an arm): no max_active_batch beside it.
        Lever("tuner", (*on(drafter), f"engine.spec.tuner_arms={json.dumps(arms)}", "engine.spec.max_active_batch=null"), note),
        Lever("spot", (*on(drafter), "spot.enabled=true"), skip=learned or idle),
        Lever("bubble", (*on(f"pregenerated+{drafter}"), "bubble.enabled=true"), skip=idle),
        Lever("steal", ("rollout.work_stealing=true", "rollout.long_first=true"), skip=ranks),
        Lever("split", ("rollout.split_groups=true",), skip=split),
        Lever("long_first", ("rollout.long_first=true",)),
        Lever("history", on(history), recurrence_note(cfg)),
        Lever("das", (*on(drafter), *budget), f"long rows: engine.spec.long_row_tokens={spec.long_row_tokens} generated or "
                                                 "predicted from the prompt's earlier responses", skip=deepest),
    ]


def choose(all_levers: list[Lever], names: str | None) -> list[Lever]:
    """The levers named in `names` ('spot,bubble'; None: all), in LEVERS' order; ValueError naming an unknown one."""
    if names is None:
        return all_levers
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    for n in wanted:
        if n not in LEVERS:
            close = difflib.get_close_matches(n, LEVERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--levers: unknown lever {n!r}{hint}; the levers are {', '.join(LEVERS)}")
    return [lever for lever in all_levers if lever.name in wanted]


@dataclass(frozen=True)
class WayTimes:
    """One way's means over steps 2..N of a run's metric rows (step 1 pays one-time costs)."""

    step_s: float
    rollout_s: float
    idle_s: float
    logprob_s: float
    update_s: float
    sync_s: float
    accept_len: float | None  # None: no speculative step
    r_gen: float  # the generation phase (rollout + idle: until every rank is done) / step, step by step
    idle_share: float  # idle / step, step by step
    exchange_s: float = 0.0  # handing rows to the ranks that train them (rollout.work_stealing): part of the generation phase
    busy_share: float | None = None  # the ranks' mean rollout / the slowest rank's
    idle_to_last_start: float | None = None  # idle share of rank-seconds until the step's last unit was taken (stealing)
    history_coverage: float | None = None  # the share of speculative row-steps history drafted (None: no history part)
    history_accept_len: float | None = None  # tokens emitted per row-step history drafted
    skipped_share: float | None = None  # response tokens the update left out (advantage 0: trainer.skip_zero_advantage)

    @property
    def gen_s(self) -> float:
        """The generation phase: until every rank's rollouts were done (a synchronous step waits for the
        last) and, with work stealing, exchanged."""
        return self.rollout_s + self.idle_s + self.exchange_s

    @classmethod
    def of(cls, *rounds: list[dict]) -> WayTimes:
        """Means over steps 2..N of each round's rows (one run of the way per round, `--repeats`)."""
        later = [m for rows in rounds for m in rows[1:]]
        if not later:
            raise ValueError("a way's summary needs two or more steps (step 1 is excluded)")

        def mean_of(key: str) -> float | None:  # over the steps that report it
            values = [m[key] for m in later if key in m]
            return mean(values) if values else None

        return cls(exchange_s=mean_of("timing/exchange") or 0.0, busy_share=mean_of("rollout/busy_share"),
                   idle_to_last_start=mean_of("rollout/idle_to_last_start"),
                   step_s=mean([m["timing/step"] for m in later]),
                   **{f"{part}_s": mean([m[f"timing/{part}"] for m in later]) for part in PARTS},
                   accept_len=mean_of("spec/accept_len"), history_coverage=mean_of("spec/history_coverage"),
                   history_accept_len=mean_of("spec/history_accept_len"),
                   skipped_share=mean_of("train/skipped_token_share"),
                   r_gen=mean([(m["timing/rollout"] + m["timing/idle"]) / m["timing/step"] for m in later]),
                   idle_share=mean([m["timing/idle"] / m["timing/step"] for m in later]))


def ceiling(r_gen: float, alpha: float) -> float:
    """The step-time ratio speculation could reach at most: the rollout (a share r_gen of the step)
    `alpha` times faster, the rest unchanged (1 / (r_gen / alpha + 1 - r_gen))."""
    if not 0 <= r_gen <= 1 or alpha <= 0:
        raise ValueError(f"the ceiling needs 0 <= R_gen <= 1 and alpha > 0, got R_gen {r_gen} and alpha {alpha}")
    return 1.0 / (r_gen / alpha + 1.0 - r_gen)


def against(base: WayTimes, way: WayTimes, identical: bool) -> dict:
    """A way beside all-off: step and generation-phase ratios (all-off / way), its accept length, identical."""
    return {"step_ratio": round(base.step_s / way.step_s, 3), "rollout_ratio": round(base.gen_s / way.gen_s, 3),
            "accept_len": None if way.accept_len is None else round(way.accept_len, 3), "identical": identical}


def headline(ways: dict[str, WayTimes], identical: dict[str, bool]) -> dict:
    """The bench's result from each way's times ('all-off', 'as-shipped', then levers) and whether
    each way but all-off was the same run as all-off."""
    off, shipped = ways["all-off"], ways["as-shipped"]
    top = ceiling(off.r_gen, shipped.accept_len or 1.0)  # no speculation: the rollout no faster
    # The same bound at the generation phase's measured ratio: where verifying costs per token (a
    # CPU), alpha overstates what speculation gives the rollout; this says how much of the gap is the
    # rollout's own and how much the step around it.
    measured = ceiling(off.r_gen, off.gen_s / shipped.gen_s)
    vs = {name: against(off, ways[name], identical[name]) for name in ways if name != "all-off"}
    return {"step_ratio": vs["as-shipped"]["step_ratio"], "rollout_ratio": vs["as-shipped"]["rollout_ratio"],
            "accept_len": vs["as-shipped"]["accept_len"], "r_gen": round(off.r_gen, 3), "idle_share": round(off.idle_share, 3),
            "update_skipped_share": None if off.skipped_share is None else round(off.skipped_share, 3),
            "ceiling": round(top, 3), "of_ceiling": round(off.step_s / shipped.step_s / top, 3),
            "rollout_bound": round(measured, 3), "of_rollout_bound": round(off.step_s / shipped.step_s / measured, 3),
            "identical": all(identical.values()), "identical_ways": identical,
            "levers": {name: v for name, v in vs.items() if name != "as-shipped"},
            "ways": {name: {k: None if v is None else round(v, 4) for k, v in asdict(w).items()} for name, w in ways.items()}}


def step_ratios(off: list[dict], way: list[dict]) -> list[float]:
    """all-off's step seconds / the way's, step by step over steps 2..N (the same steps: the same run)."""
    return [round(a["timing/step"] / b["timing/step"], 3) for a, b in zip(off[1:], way[1:])]


def round_name(way: str, k: int) -> str:
    """The run folder of round k (from 0) of a way: the way's name, then `way@2`, `way@3`..."""
    return way if k == 0 else f"{way}@{k + 1}"


def runnable(config: str, common: list[str], lever: Lever, out: Path) -> Lever:
    """The lever, with its config's validation error as the reason to skip it (if it has one)."""
    if lever.skip is None:
        try:
            plan_config(config, common, [*ALL_OFF, *lever.overrides], out / lever.name, f"e2e-{lever.name}")
        except ValueError as e:
            return replace(lever, skip=str(e))
    return lever


def plot(path: Path, off: list[dict], shipped: list[dict], title: str) -> None:
    """Each step's time split as stacked bars, all-off (plain) beside as-shipped (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(off) + 2), 4.8))
    colours = plt.get_cmap("tab10").colors
    for shift, rows, hatch in ((-0.2, off, None), (0.2, shipped, "//")):
        x = [i + 1 + shift for i in range(len(rows))]
        bottom = [0.0] * len(rows)
        for k, part in enumerate((*PARTS, "other")):
            # other: what the step spent outside the named phases (bookkeeping, metrics)
            h = [max(0.0, m["timing/step"] - sum(m[f"timing/{q}"] for q in PARTS)) if part == "other" else m[f"timing/{part}"]
                 for m in rows]
            ax.bar(x, h, 0.38, bottom=bottom, color=colours[k], hatch=hatch, edgecolor="white" if hatch else None,
                   label=part if hatch is None else None)
            bottom = [b + v for b, v in zip(bottom, h)]
    ax.bar([1], [0], 0.38, color="lightgrey", hatch="//", edgecolor="white", linewidth=0, label="as shipped (hatched)")
    ax.set_xticks(range(1, len(off) + 1))
    ax.set_ylim(0, 2.0 * max(m["timing/step"] for m in (*off, *shipped)))  # room for the legend above the bars
    ax.set_xlabel("RL step (left: all levers off, right: as shipped)")
    ax.set_ylabel("seconds")
    save_plot(fig, ax, path, title)


def report(result: dict, chosen: list[Lever]) -> None:
    """The human table and summary on stderr."""
    err = lambda s: print(s, file=sys.stderr)  # noqa: E731
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    err(f"cpu: {result['cpu']}; {result['world_size']} rank(s); means over steps 2..{result['steps']}")
    err(f"{'way':<11} {'step s':>7} {'rollout s':>9} {'update s':>8} {'idle s':>7} {'accept':>6} {'busy':>5} {'vs all-off':>10} "
        "identical")
    off = result["ways"]["all-off"]["step_s"]
    for name, w in result["ways"].items():
        err(f"{name:<11} {w['step_s']:>7.2f} {w['rollout_s']:>9.2f} {w['update_s']:>8.2f} {w['idle_s']:>7.2f} "
            f"{fmt(w['accept_len']):>6} {fmt(w['busy_share']):>5} {off / w['step_s']:>10.3f} {result['identical_ways'].get(name, '-')}")
        if w["idle_to_last_start"] is not None:
            err(f"{'':<11} idle share of rank-seconds until the last unit started: {w['idle_to_last_start']:.3f}")
    err(f"step ratio all-off / as-shipped {result['step_ratio']:.3f}x, worst step {result['worst_step_ratio']:.3f}x "
        f"(steps 2..N: {', '.join(f'{x:.3f}' for x in result['step_ratios'])}); rollout {result['rollout_ratio']:.3f}x")
    err(f"all-off: "
        f"R_gen {result['r_gen']:.2f}, idle share {result['idle_share']:.2f}; as-shipped accept length "
        f"{fmt(result['accept_len'], '.3f')}; ceiling {result['ceiling']:.2f}x ({result['of_ceiling']:.0%} of it)")
    err(f"at the generation phase's measured ratio ({result['rollout_ratio']:.3f}x, not alpha) the same bound is "
        f"{result['rollout_bound']:.2f}x (the step ratio {result['of_rollout_bound']:.0%} of it)")
    if result["update_skipped_share"]:
        err(f"all-off's update left out {result['update_skipped_share']:.0%} of the response tokens (rows of advantage 0, "
            "no gradient: trainer.skip_zero_advantage)")
    for name, lever in result["levers"].items():
        err(f"  + {name}: step ratio {lever['step_ratio']:.3f}x, rollout {lever['rollout_ratio']:.3f}x")
    for name, w in result["ways"].items():
        if w["history_coverage"] is not None:
            err(f"  {name}: history drafts on {w['history_coverage']:.0%} of speculative row-steps, accept length "
                f"{fmt(w['history_accept_len'])} there")
    for lever in chosen:
        if lever.skip:
            err(f"  + {lever.name}: skipped: {lever.skip}")
        elif lever.note:
            err(f"  ({lever.name}: {lever.note})")
    err(f"identical runs: {result['identical']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[1])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--levers", default=None, help=f"comma-separated subset of {','.join(LEVERS)} (default: all; all-off "
                                                  "and as-shipped always run)")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    p.add_argument("--plot", default=None, help="write each step's time split, all-off beside as-shipped, to this PNG")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every way this many times, in rounds (all-off, as-shipped, levers; again), and average: "
                        "a drift of the machine's speed over the bench then weighs on every way alike")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value, applied to every run (before the ways' own)")
    args = p.parse_args(argv)
    if args.steps < 2:
        print(f"error: --steps must be >= 2 (step 1 is excluded from the timing), got {args.steps}", file=sys.stderr)
        return 1
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 1
    out = Path(args.out or tempfile.mkdtemp(prefix="tailspec-e2e-"))
    common = bench_overrides(args.steps, args.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; pipeline.dist.init_ranks reads the same
    try:
        shipped = load_config(TrainConfig, args.config, common)
        chosen = [runnable(args.config, common, lever, out) for lever in choose(levers(shipped, world), args.levers)]
        ways = [("all-off", list(ALL_OFF)), ("as-shipped", []),
                *((lever.name, [*ALL_OFF, *lever.overrides]) for lever in chosen if lever.skip is None)]
        plan = [(round_name(name, k), extra) for k in range(args.repeats) for name, extra in ways]
        runs, r = train_runs(args.config, plan, common, out, "e2e")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not r.main:
        return 0
    rows = {name: read_metrics(folder) for name, folder in runs.items()}
    rounds = {name: [round_name(name, k) for k in range(args.repeats)] for name, _ in ways}
    # Every run of every way must be the same run as all-off's first.
    identical = {name: all(same_steps(rows["all-off"], rows[run]) and same_weights(runs["all-off"], runs[run], args.steps)
                           for run in rounds[name] if run != "all-off")
                 for name in rounds if name != "all-off" or args.repeats > 1}
    times = {name: WayTimes.of(*(rows[run] for run in rounds[name])) for name in rounds}
    by_round = [round(WayTimes.of(rows[round_name("all-off", k)]).step_s / WayTimes.of(rows[round_name("as-shipped", k)]).step_s, 3)
                for k in range(args.repeats)]
    per_step = [x for k in range(args.repeats)
                for x in step_ratios(rows[round_name("all-off", k)], rows[round_name("as-shipped", k)])]
    result = {**headline(times, identical), "repeats": args.repeats, "step_ratio_by_round": by_round,
              "step_ratios": per_step, "worst_step_ratio": min(per_step),
              "skipped": {lever.name: lever.skip for lever in chosen if lever.skip},
              "notes": {lever.name: lever.note for lever in chosen if lever.note and not lever.skip},
              "steps": args.steps, "world_size": r.world, "config": args.config, "overrides": args.overrides,
              "cpu": cpu_model(), "runs": {k: str(v) for k, v in runs.items()}}
    report(result, chosen)
    if args.repeats > 1:
        print(f"step ratio all-off / as-shipped by round: {', '.join(f'{x:.3f}x' for x in by_round)}", file=sys.stderr)
    if args.plot:
        plot(Path(args.plot), rows["all-off"], rows["as-shipped"], f"{args.config}: each step's time, {result['cpu']}")
        print(f"wrote {args.plot}", file=sys.stderr)
    finish(result, args.json)
    return 0 if result["identical"] else 2


if __name__ == "__main__":
    sys.exit(main())
