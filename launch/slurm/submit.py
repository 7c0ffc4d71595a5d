"""`python -m launch.slurm --config configs/7b.yaml [--dry-run] [section.key=value ...]`: submit an RL run to Slurm.

`make train-7b` / `make train-32b` call this. It loads the config and overrides, runs the
submission preflight (launch.slurm.preflight), renders the sbatch script (launch.slurm.sbatch), writes it
to cluster.log_dir and submits it with `sbatch`. `--dry-run` (or `DRY_RUN=1` in the environment)
prints the script, the resolved config and the preflight's table instead, all as one valid
bash file, and submits nothing. docs/CLUSTER.md walks through a first job.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from common.atomic import atomic_file
from common.config import load_config, override_args, to_dict
from launch.slurm.preflight import report, submit_checks
from launch.run.config import TrainConfig
from launch.slurm.sbatch import render_sbatch

REPO = Path(__file__).resolve().parents[2]


def dry_run_requested(flag: bool, environ=os.environ) -> bool:
    return flag or environ.get("DRY_RUN", "").lower() in ("1", "true", "yes")


def _commented(text: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())


def render(cfg: TrainConfig, config_path: str, overrides: list[str], repo: Path = REPO) -> str:
    if cfg.trainer.resume not in (None, "auto"):
        raise ValueError(f"trainer.resume={cfg.trainer.resume}: a Slurm job resumes its own run folder; to continue "
                         "an earlier job's run, submit with run.dir=<that run's folder> (it resumes the latest checkpoint)")
    rel = os.path.relpath(Path(config_path).resolve(), repo)
    return render_sbatch(cfg, rel if not rel.startswith("..") else str(Path(config_path).resolve()), overrides, repo,
                         job_name=f"tailspec-{cfg.run.name}")


def submit(script: str, cfg: TrainConfig, repo: Path = REPO) -> str:
    """Write the script beside the job logs and sbatch it; returns the job id."""
    log_dir = repo / cfg.cluster.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    with atomic_file(path) as f:
        f.write(script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, cwd=repo)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job} ({path})\n"
          f"  queue:   squeue -j {job}\n"
          f"  output:  tail -f {log_dir}/tailspec-{cfg.run.name}-{job}.out\n"
          f"  run:     {cfg.run.dir or f'{cfg.run.out_dir}/{cfg.run.name}-{job}'} (metrics.jsonl, checkpoints/, rank*.log)\n"
          f"  W&B:     project {cfg.metrics.wandb_project}, mode {cfg.metrics.wandb_mode}\n"
          f"  stop:    scancel {job}", flush=True)
    return job


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.splitlines()[0],
                                epilog="Any section.key=value argument overrides the config file.")
    p.add_argument("--config", required=True)
    p.add_argument("--dry-run", action="store_true", help="print the script, resolved config and preflight; submit nothing")
    args = p.parse_args(rest)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
        script = render(cfg, args.config, overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    checks = submit_checks(cfg, REPO)
    table = report(checks, "preflight (before submission):")
    if dry_run_requested(args.dry_run):
        sys.stdout.write(script + "\n# --- the resolved config (DRY_RUN: nothing was submitted) ---\n"
                         + _commented(yaml.safe_dump(to_dict(cfg), sort_keys=False)) + _commented(table))
        return 0
    print(table, flush=True)
    if any(c.failed for c in checks):
        print("error: preflight failed; nothing was submitted (fix the FAIL lines above; DRY_RUN=1 prints the script)",
              file=sys.stderr)
        return 1
    try:
        submit(script, cfg)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

