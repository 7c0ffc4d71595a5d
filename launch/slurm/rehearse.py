"""`python -m launch.slurm.rehearse 7b|32b|pool [--dir runs/rehearse] [section.key=value ...]`: the cluster job,
rehearsed on this machine as a two-node Slurm job.

`make train-7b` / `make train-32b` submit configs/7b.yaml / configs/32b.yaml. The rehearsal runs that
very code path here with only sizes and devices changed (configs/rehearse/<name>.yaml, an overlay a
test keeps to sizes and devices): the model SmolLM2-135M-Instruct (`make models`) on CPU, a short
`max_len`, a few rows and steps. Everything else is as shipped: the actor backend and ZeRO stage, the
placement, spot training, the tuner, the algorithm, W&B (offline), checkpoints and the sbatch script.
`pool` is the 7B rehearsal in another layout (LAYOUT_KEYS as well): the separated placement on two
ranks per node, its drafter trained by an elastic spot pool with an agent on each node
(spot.mode: pool, launch.slurm.sbatch), so that the pool's part of the script runs on a real Slurm too.

1. Its inputs, made once under `--dir` and kept: data/raw.parquet, word problems in verl's layout
   (pipeline.data.stand_in), converted by `pipeline.data.prepare --format verl` into
   data/train.jsonl and data/test.jsonl; drafter/, a short warm start of an EAGLE drafter for
   SmolLM2 on those prompts (launch.warmstart).
2. A Slurm cluster of two nodes on this host (launch.slurm.local: one slurmd per node, `<host>-n1`
   and `<host>-n2`; each node's tasks see their own SLURMD_NODENAME, so each has its own DataBuffer
   segment). It needs root on Debian (it apt-installs slurm-wlm and munge if missing).
3. The job, submitted by `python -m launch.slurm` (the code path of `make train-7b`): the sbatch
   script as rendered, its preflight and torchrun lines unchanged, one torchrun agent per node
   meeting at the first node's c10d rendezvous. Its output is followed here.
4. What it cost and showed: the job's time, its steps, the run folder and dashboard, and each rank's
   peak resident memory beside the memory planner's for the rehearsal (launch.memory).

The job's files live under `--dir`: runs/<name>-<job id>/ (metrics.jsonl, dashboard.png,
checkpoints/, rank*.log, wandb/), slurm/ (the script and the job's output). The cluster's own
folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.config import load_config, override_args
from launch.slurm.local import NOT_ENDED, LocalSlurm, SlurmUnavailable
from launch.run.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {name: REPO / f"configs/rehearse/{name}.yaml" for name in ("7b", "32b", "pool")}
SHIPPED = {"7b": "7b", "32b": "32b", "pool": "7b"}  # the configs/<shipped>.yaml each rehearses
DEFAULT_DIR = REPO / "runs/rehearse"
# What an overlay may change: sizes (rows, lengths, steps, buffers, nodes), devices and dtypes, where the
# inputs and outputs are, and W&B's mode. tests/test_rehearse_config.py holds the overlays to this list
# and checks that their resolved configs differ from the shipped ones in these keys only.
OVERLAY_KEYS = frozenset({
    "run.name", "run.out_dir", "model.path",
    "task.file", "task.eval_file", "task.reward_workers", "task.eval_problems", "task.eval_max_new_tokens",
    "pipeline.actor_ranks",
    "engine.device", "engine.dtype", "engine.max_batch", "engine.max_len", "engine.spec.drafter_path",
    "rollout.n", "rollout.max_new_tokens", "algorithm.overlong_buffer",
    "actor.device", "actor.dtype", "actor.micro_batch_tokens",
    "trainer.steps", "trainer.prompts_per_step", "trainer.mini_batches", "trainer.eval_every", "trainer.save_every",
    "metrics.wandb_mode",
    "spot.buffer_mb", "spot.buffer_entries", "spot.feature_dtype", "spot.rows_per_step",
    "cluster.nodes", "cluster.gpus_per_node", "cluster.procs_per_node", "cluster.cpus_per_task", "cluster.time",
    "cluster.log_dir",
})
# What a rehearsal in another layout than its shipped config's (`pool`) changes as well: where the
# actor trains and who trains the drafter. tests/test_rehearse_config.py holds it to these.
LAYOUT_KEYS = frozenset({"pipeline.placement", "pipeline.actor_ranks", "spot.mode", "spot.pool_dir"})
DATA_ROWS = 200  # enough for 3 steps of 4 prompts and the held-out set
WARMSTART = ["--max-prompts", "8", "--steps", "16", "--max-minutes", "4"]  # a drafter to run, not a good one


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    last = [line for line in proc.stdout.splitlines() if line.strip()]
    if last:
        print(f"  {last[-1]}", flush=True)


def job_overrides(root: Path) -> list[str]:
    """The overrides that point the overlay's inputs and outputs at `root` (its defaults: runs/rehearse)."""
    root = Path(root).resolve()
    return [f"task.file={root / 'data/train.jsonl'}", f"task.eval_file={root / 'data/test.jsonl'}",
            f"engine.spec.drafter_path={root / 'drafter'}", f"run.out_dir={root / 'runs'}",
            f"spot.pool_dir={root / 'pool'}", f"cluster.log_dir={root / 'slurm'}", f"cluster.python={sys.executable}"]


def prepare_inputs(root: Path, name: str = "7b") -> None:
    """The data and the drafter under `root`, each made once (a folder that exists is kept)."""
    root = Path(root).resolve()
    data, py = root / "data", sys.executable
    if not (data / "train.jsonl").is_file():
        print(f"data: {DATA_ROWS} word problems in verl's layout -> {data} (pipeline.data.stand_in, pipeline.data.prepare)",
              flush=True)
        data.mkdir(parents=True, exist_ok=True)
        _run([py, "-m", "pipeline.data.stand_in", "--layout", "verl", str(data / "raw.parquet"), "--rows", str(DATA_ROWS)],
             "the stand-in data")
        _run([py, "-m", "pipeline.data.prepare", "--format", "verl", str(data / "raw.parquet"), str(data)], "prepare")
    if not (root / "drafter" / "config.json").is_file():
        print(f"drafter: a short warm start for SmolLM2 -> {root / 'drafter'} (launch.warmstart)", flush=True)
        _run([py, "-m", "launch.warmstart", "--config", str(CONFIGS[name]), *job_overrides(root),
              "--out", str(root / "drafter"), *WARMSTART], "the drafter's warm start")


@dataclass
class Job:
    """A submitted rehearsal job: its id, run folder and output file."""

    id: str
    run_dir: Path
    out: Path


def submit(slurm: LocalSlurm, name: str, root: Path, extra: list[str] = ()) -> Job:
    """`python -m launch.slurm --config configs/rehearse/<name>.yaml` against `slurm`, as a user submits."""
    cfg = load_config(TrainConfig, CONFIGS[name], [*job_overrides(root), *extra])
    env = {**slurm.env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "launch.slurm", "--config", str(CONFIGS[name]), *job_overrides(root),
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or "submitted job " not in proc.stdout:
        raise RuntimeError(f"launch.slurm failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    job = proc.stdout.split("submitted job ")[1].split()[0]
    return Job(job, Path(cfg.run.out_dir).resolve() / f"{cfg.run.name}-{job}",
               Path(cfg.cluster.log_dir).resolve() / f"tailspec-{cfg.run.name}-{job}.out")


def follow(slurm: LocalSlurm, job: Job, timeout_s: float, echo: bool = True,
           until: Callable[[], bool] | None = None) -> dict[str, str]:
    """Prints the job's new output lines until it ends (or `until()` holds); -> `scontrol show job`'s fields."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while True:
        text = job.out.read_text(errors="replace") if job.out.is_file() else ""
        if echo and len(text) > seen:
            for line in text[seen:].splitlines():
                if line.strip() and "Warning" not in line and "return func" not in line:
                    print(f"  | {line}", flush=True)
            seen = len(text)
        info = slurm.job(job.id)
        if info.get("JobState") not in NOT_ENDED:
            return info
        if until is not None and until():
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job.id], env=slurm.env, capture_output=True)
            raise TimeoutError(f"job {job.id} did not end within {timeout_s:.0f} s (cancelled); its output: {job.out}")
        time.sleep(1)


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


PEAK_LINE = re.compile(r"step \d+: peak RSS ([\d.]+) GB on rank (\d+)")


def peak_memory(run_dir: Path) -> dict[int, float]:
    """Each rank's peak resident memory in GB over the run, from the lines every rank writes to its
    log after each step ("step N: peak RSS X GB on rank R"; both placements write them)."""
    peaks: dict[int, float] = {}
    for log in sorted(Path(run_dir).glob("rank*.log")):
        for gb, rank in PEAK_LINE.findall(log.read_text(errors="replace")):
            peaks[int(rank)] = max(peaks.get(int(rank), 0.0), float(gb))
    return peaks


def memory_table(name: str, root: Path, run_dir: Path) -> str:
    """The planner's peak for each rank's role in the rehearsal, beside the rank's measured peak."""
    from launch.memory.report import model_config, plan_for
    cfg = load_config(TrainConfig, CONFIGS[name], job_overrides(root))
    p = plan_for(cfg, model_config(cfg, None))
    roles = {r.role: r for r in p.roles}
    actors, _ = cfg.pipeline.roles(cfg.cluster.world_size)
    lines = ["rank  role       planned GB  measured GB  planned / measured"]
    for rank, measured in sorted(peak_memory(run_dir).items()):
        role = "colocated" if not cfg.pipeline.separated else ("actor" if rank < actors else "rollout")
        planned = roles[role].peak / 1e9 if role in roles else float("nan")
        lines.append(f"{rank:>4}  {role:<9}  {planned:10.2f}  {measured:11.2f}  {planned / measured:18.2f}")
    return "\n".join(lines)


def rehearse(name: str, root: Path = DEFAULT_DIR, extra: list[str] = (), timeout_s: float = 900) -> int:
    root = Path(root).resolve()
    started = time.monotonic()
    print(f"rehearsal of configs/{SHIPPED[name]}.yaml: configs/rehearse/{name}.yaml as a two-node Slurm job on this machine",
          flush=True)
    prepare_inputs(root, name)
    with LocalSlurm(root / "cluster", nodes=2) as slurm:
        print(f"cluster: nodes {', '.join(slurm.nodes)} (one slurmd each, on this host)", flush=True)
        job = submit(slurm, name, root, list(extra))
        print(f"job {job.id}: run folder {job.run_dir}; output {job.out}", flush=True)
        info = follow(slurm, job, timeout_s)
    ok = info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0"
    steps = [r["step"] for r in metrics(job.run_dir) if "rollout/batch_size" in r]
    print(f"job {job.id}: {info.get('JobState')} (exit {info.get('ExitCode')}), steps {steps}, "
          f"{time.monotonic() - started:.0f} s in all", flush=True)
    if (job.run_dir / "dashboard.png").is_file():
        print(f"dashboard: {job.run_dir / 'dashboard.png'}", flush=True)
    if peak_memory(job.run_dir):
        print("peak memory of the rehearsal's ranks (resident, GB) beside the planner's "
              f"(python -m launch.memory --config configs/rehearse/{name}.yaml):\n{memory_table(name, root, job.run_dir)}",
              flush=True)
    print(f"the real sizes' plan: python -m launch.memory --config configs/{SHIPPED[name]}.yaml --model-config "
          f"launch/model_configs/qwen2.5-{SHIPPED[name]}-instruct.json", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m launch.slurm.rehearse", description=__doc__.splitlines()[0],
                                epilog="Any section.key=value argument overrides the rehearsal's config.")
    p.add_argument("name", choices=sorted(CONFIGS), help="the rehearsal: configs/rehearse/<name>.yaml")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="inputs, runs and job logs (default: runs/rehearse)")
    p.add_argument("--timeout-s", type=float, default=900, help="cancel the job past this many seconds")
    args = p.parse_args(rest)
    try:
        return rehearse(args.name, Path(args.dir), overrides, args.timeout_s)
    except (SlurmUnavailable, RuntimeError, TimeoutError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
