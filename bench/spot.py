"""`torchrun --nproc-per-node=2 -m bench.spot --config configs/tiny.yaml --steps N [--repeats K] [--plot F.png] [--json]`:
RL steps with spot training on vs a frozen drafter, side by side.

After a discarded one-step warm-up run, runs the same N RL steps twice in this process group (same seeds, same data, both speculative):
once with the config's spot training, once with `spot.enabled=false` (the warm-started drafter,
frozen). The drafter never changes a token, so the two runs must be identical (every step's
rewards and losses, the final policy weights); the bench checks it. It prints, per step, the
accept length of both runs; and over steps 2..N (step 1 pays one-time costs):

- the step-time ratio (spot / frozen: of the mean step times, and the median of the per-step
  ratios, both runs rolling out the same tokens step by step): spot training must be free;
- the share of idle rank-seconds spent training (`spot/utilisation`) and the worst overrun past
  the end of an idle window (`spot/overrun_s`);
- the accept-length ratio at the last step (spot / frozen; TLT reports 6.53 / 4.59 = 1.42) and the
  spot run's last accept length against its first (the drafter follows the policy: within 10%).

`--repeats K` runs each way K times in ABBA order (spot, frozen, frozen, spot, ...) and pools the
step times: on a shared or virtual machine whose speed drifts over minutes, one run of each way
can differ by more than the 1% being measured, and ABBA cancels a linear drift. Every run must be
identical to the first.

Spot training needs idle windows, so run it on two or more ranks. `--plot` writes the two
accept-length curves (PNG). Prints the CPU model; `--json` ends with one line
`{"step_ratio", "utilisation", "accept_ratio_last", "accept_spot_vs_start", "identical", ...}`.
It also prints rank 0's time until its idle window closed (rollouts, then the window: the phase
spot training acts in; with spot training there is no barrier after the window, the ranks meet at
the actor's update: common.idle) of both ways, and exits 3 when a spot run trained nothing at all.
`--prefault-gb G` makes each rank first touch G GiB of memory (on a VM that backs memory lazily, the way that
uses more memory pays first touches in phases spot training does not run in).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import cpu_model, finish, prefault_memory, save_plot
from bench.runs import bench_overrides, mean, read_metrics, same_steps, same_weights, train_runs


def run_name(way: str, repeat: int) -> str:
    """The run folder of a way's repeat: spot, frozen, then spot2, frozen2, ..."""
    return way if repeat == 0 else f"{way}{repeat + 1}"


def smooth(xs: list[float], k: int) -> list[float]:
    """Trailing mean over up to k values (accept lengths of single steps are noisy)."""
    return [mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def plot(path: Path, spot: list[float], frozen: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(spot) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, spot, "o-", label="spot-trained drafter")
    ax.plot(steps, frozen, "s--", label="frozen drafter")
    ax.set_xlabel("RL step")
    ax.set_ylabel("accept length (tokens per verify)")
    save_plot(fig, ax, path, title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spot", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--smooth", type=int, default=3, help="trailing mean over this many steps for the first/last values")
    p.add_argument("--out", default=None, help="folder for the two runs (default: a temporary one)")
    p.add_argument("--plot", default=None, help="write the accept-length curves to this PNG")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the discarded warm-up run")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each way this many times in ABBA order (spot, frozen, frozen, spot, ...): the step ratio "
                        "pools them, so a drift of the machine's speed during the bench cancels")
    p.add_argument("--prefault-gb", type=float, default=0.0,
                   help="each rank touches this many GiB of memory once before the runs (bench.common.prefault_memory: on a VM "
                        "that backs memory lazily, the way that uses more memory pays first touches elsewhere)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value, applied to both runs")
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        print("error: --steps must be >= 2 (step 1 is excluded from the timing) and --repeats >= 1", file=sys.stderr)
        return 1
    out = Path(args.out or tempfile.mkdtemp(prefix="tailspec-spot-"))
    prefault = prefault_memory(args.prefault_gb) if args.prefault_gb > 0 else None  # every rank: the host's pages either way
    # A discarded one-step run first: one-time costs (kernel builds, caches) would favour the second run.
    plan = [("warmup", ["spot.enabled=false", "trainer.steps=1"])] if args.warmup else []
    ways = [("spot", ["spot.enabled=true"]), ("frozen", ["spot.enabled=false"])]
    for k in range(args.repeats):  # ABBA: linear drift of the machine's speed cancels in the pooled ratio
        plan += [(run_name(way, k), extra) for way, extra in (ways if k % 2 == 0 else ways[::-1])]

    def check(cfg, r) -> None:
        if not cfg.engine.spec.enabled:
            raise ValueError("bench.spot compares drafters: it needs engine.spec.enabled=true")

    try:
        runs, r = train_runs(args.config, plan, bench_overrides(args.steps, args.overrides), out, "spot", check)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not r.main:
        return 0
    reps = {way: [read_metrics(runs[run_name(way, k)]) for k in range(args.repeats)]
            for way in ("spot", "frozen")}
    on, off = reps["spot"][0], reps["frozen"][0]
    identical = (all(same_steps(on, m) for ms in reps.values() for m in ms)
                 and all(same_weights(runs["spot"], runs[name], args.steps) for name in runs if name not in ("warmup", "spot")))
    acc_on = [m.get("spec/accept_len", float("nan")) for m in on]
    acc_off = [m.get("spec/accept_len", float("nan")) for m in off]
    s_on, s_off = smooth(acc_on, args.smooth), smooth(acc_off, args.smooth)
    t_on = mean([m["timing/step"] for ms in reps["spot"] for m in ms[1:]])
    t_off = mean([m["timing/step"] for ms in reps["frozen"] for m in ms[1:]])
    paired = sorted(a["timing/step"] / b["timing/step"]  # same rollouts, step by step
                    for ms_on, ms_off in zip(reps["spot"], reps["frozen"]) for a, b in zip(ms_on[1:], ms_off[1:]))
    # Until rank 0's window closed (its rollouts, then its window): the phase spot training acts in.
    # The actor's update after it runs no spot work, yet its time moves by several % between runs.
    to_barrier = {way: mean([m["timing/rollout/rank0"] + m["timing/idle/rank0"] for ms in reps[way] for m in ms[1:]])
                  for way in reps if "timing/rollout/rank0" in reps[way][0][-1]}
    idle = sum(m.get("spot/idle_s", 0.0) for ms in reps["spot"] for m in ms[1:])
    trained = sum(m.get("spot/train_s", 0.0) for ms in reps["spot"] for m in ms[1:])
    result = {
        "step_ratio": round(t_on / t_off, 4), "step_ratio_median": round(paired[len(paired) // 2], 4), "step_s_spot": round(t_on, 3), "step_s_frozen": round(t_off, 3),
        "utilisation": round(trained / idle, 3) if idle > 0 else None,
        "dropped_s_per_step": round(sum(m.get("spot/dropped_s", 0.0) for ms in reps["spot"] for m in ms[1:])
                                    / (len(on) - 1) / args.repeats, 4),  # of the utilisation: work the window's end dropped (a chunk in flight)
        "idle_s_per_step": round(idle / (len(on) - 1) / args.repeats, 3),
        "overrun_s_max": round(max(m.get("spot/overrun_s", 0.0) for ms in reps["spot"] for m in ms), 3),
        "micro_steps": int(sum(m.get("spot/micro_steps", 0.0) for m in on)), "repeats": args.repeats,
        "micro_steps_per_run": [int(sum(m.get("spot/micro_steps", 0.0) for m in ms)) for ms in reps["spot"]],
        "to_barrier_s": {way: round(v, 4) for way, v in to_barrier.items()},
        "accept_spot": [round(x, 3) for x in acc_on], "accept_frozen": [round(x, 3) for x in acc_off],
        "accept_ratio_last": round(s_on[-1] / s_off[-1], 3), "accept_spot_vs_start": round(s_on[-1] / s_on[0], 3),
        "accept_frozen_vs_start": round(s_off[-1] / s_off[0], 3), "smooth": args.smooth,
        "identical": identical, "steps": args.steps, "world_size": r.world, "prefault": prefault,
        "config": args.config, "overrides": args.overrides, "cpu": cpu_model(), "runs": {k: str(v) for k, v in runs.items()},
    }
    print(f"cpu: {result['cpu']}", file=sys.stderr)
    print(f"{'step':>5} {'accept spot':>12} {'accept frozen':>14} {'step s spot':>12} {'step s frozen':>14}", file=sys.stderr)
    for i, (a, b) in enumerate(zip(on, off)):
        print(f"{i + 1:>5} {acc_on[i]:>12.2f} {acc_off[i]:>14.2f} {a['timing/step']:>12.2f} {b['timing/step']:>14.2f}",
              file=sys.stderr)
    print(f"step ratio (spot / frozen, steps 2..N, {args.repeats} run(s) each) {result['step_ratio']:.3f} (median of step pairs "
          f"{result['step_ratio_median']:.3f}); utilisation {result['utilisation']}; "
          f"max overrun {result['overrun_s_max']} s; {result['micro_steps']} micro-steps; work dropped at the window's end "
          f"{result['dropped_s_per_step']} s a step", file=sys.stderr)
    print(f"accept length, {args.smooth}-step mean: spot {s_on[0]:.2f} -> {s_on[-1]:.2f} ({result['accept_spot_vs_start']:.2f}x), "
          f"frozen {s_off[0]:.2f} -> {s_off[-1]:.2f} ({result['accept_frozen_vs_start']:.2f}x); last step spot / frozen "
          f"{result['accept_ratio_last']:.2f}; identical runs: {result['identical']}", file=sys.stderr)
    if len(to_barrier) == 2:
        d = to_barrier["spot"] - to_barrier["frozen"]
        print(f"until rank 0's window closed (rollouts, then the window): spot {to_barrier['spot']:.3f} s, frozen {to_barrier['frozen']:.3f} s "
              f"a step ({d:+.3f} s, {d / t_off:+.1%} of a frozen step)", file=sys.stderr)
    idle_runs = [run_name("spot", k) for k, n in enumerate(result["micro_steps_per_run"]) if n == 0]
    if idle_runs:  # the comparison is void: a spot run that trained nothing measures the frozen drafter twice
        print(f"error: spot run(s) {', '.join(idle_runs)} trained nothing (spot/micro_steps 0 in every step): no idle "
              "window opened, or the buffer stayed empty; the step ratio does not measure spot training", file=sys.stderr)
    if args.plot:
        plot(Path(args.plot), acc_on, acc_off, f"{args.config} {' '.join(args.overrides)}\n{result['cpu']}")
        print(f"wrote {args.plot}", file=sys.stderr)
    finish(result, args.json)
    return 2 if not result["identical"] else 3 if idle_runs else 0


if __name__ == "__main__":
    sys.exit(main())
