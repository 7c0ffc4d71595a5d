"""`python -m bench.trl [--steps 3]`: TRL's GRPOTrainer and TailSpec on the same GRPO job, side by side.

The job is a TailSpec run config's (configs/smollm2.yaml by default, with dotted overrides): its
model, its training prompts in its own order (the run's loader: both sides train on the same rows,
rendered to the same tokens, which the TRL side checks), group size, response limit, sampling,
learning rate and optimiser, loss aggregation and clipping, and its reward (the math task's
math-verify correctness plus the format bonus: TailSpec's own MathVerifyReward on both sides).
`trl_settings` turns it into GRPOConfig keywords and refuses, naming the key, what TRL is not
given here (more than one optimizer step per RL step, DAPO's shaping, a learning-rate schedule).
TRL runs with `use_cpu=True`, `use_vllm=False`, `num_iterations=1` (generation and optimisation
aligned: it computes no old log-probs, as TailSpec's `trainer.old_logprobs: auto` at T != 1),
its generation batch of all the step's rows at once and `--trl-micro-rows` rows a backward.

Each side is one process, one after the other (TailSpec: `python -m launch.train`; TRL:
bench.trl_worker in .venv-trl, `make setup-trl`), on the same threads and environment. Printed
per step and as means: the step's seconds and its split (generation, old log-probs, update, the
rest: rewards, advantages, weight sync), response tokens, mean reward, and each process's peak RSS
(`wait4`'s ru_maxrss); then TRL's mean step over TailSpec's; the CPU model with them.
Each side's split is what it measures itself: TailSpec's `timing/*` metrics; TRL's profiling spans
(`transformers.generate`; `_get_per_token_logps_and_entropies` inside `_prepare_inputs` is an old
log-prob pass; the update is the step outside `_prepare_inputs`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AGGREGATION_LOSS = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}


@dataclass
class StepFigures:
    """One RL step of one side, in seconds, with its response tokens and mean reward."""

    step_s: float
    generation_s: float
    logprob_s: float  # a separate old-log-prob pass
    update_s: float
    other_s: float  # the rest of the step: rewards, advantages, weight sync, bookkeeping
    tokens: int
    reward: float


@dataclass
class Side:
    name: str
    steps: list[StepFigures]
    peak_rss_bytes: int
    wall_s: float

    @property
    def mean(self) -> StepFigures:
        n = len(self.steps)
        fields = {k: sum(getattr(s, k) for s in self.steps) / n for k in StepFigures.__dataclass_fields__}
        return StepFigures(**{**fields, "tokens": round(fields["tokens"])})


def trl_settings(cfg, micro_rows: int) -> dict:
    """GRPOConfig keywords for the job of TailSpec config `cfg`; ValueError naming what TRL is not given here."""
    from pipeline.actors import precision
    from pipeline.tasks.reward_plugins import uses_math_verify

    a, r, t, act = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.actor
    if a.name != "grpo" or a.dynamic_sampling or a.overlong_buffer:
        raise ValueError("bench.trl compares plain GRPO: set algorithm.name=grpo without dynamic sampling or "
                         f"algorithm.overlong_buffer (got {a.name}, dynamic_sampling={a.dynamic_sampling}, "
                         f"overlong_buffer={a.overlong_buffer})")
    if t.ppo_epochs != 1 or t.mini_batches != 1 or t.async_steps:
        raise ValueError("bench.trl compares one synchronous optimizer step per RL step: set trainer.ppo_epochs=1, "
                         f"trainer.mini_batches=1, trainer.async_steps=0 (got {t.ppo_epochs}, {t.mini_batches}, "
                         f"{t.async_steps})")
    if act.lr_schedule != "constant" or act.lr_warmup_steps:
        raise ValueError(f"bench.trl runs a constant learning rate: set actor.lr_schedule=constant and "
                         f"actor.lr_warmup_steps=0 (got {act.lr_schedule}, {act.lr_warmup_steps})")
    reward = cfg.task.reward
    if cfg.task.name != "math" or not (reward is None or (isinstance(reward, str) and uses_math_verify(cfg.task))):
        raise ValueError(f"bench.trl scores with math-verify: set task.name=math (got {cfg.task.name}) with its own "
                         f"reward or task.reward=math_verify (got {reward})")
    rows = t.prompts_per_step * r.n
    if micro_rows < 1 or rows % micro_rows:
        raise ValueError(f"--trl-micro-rows must divide the step's {rows} rows (trainer.prompts_per_step x "
                         f"rollout.n), got {micro_rows}")
    return {
        "learning_rate": act.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "adam_beta1": act.betas[0],
        "adam_beta2": act.betas[1], "weight_decay": act.weight_decay, "max_grad_norm": act.grad_clip,
        "bf16": precision.resolve(act) == "bf16-mixed", "gradient_checkpointing": act.gradient_checkpointing,
        "model_init_kwargs": {"dtype": "float32"},
        "num_generations": r.n, "max_completion_length": r.max_new_tokens, "temperature": r.temperature,
        "top_p": r.top_p, "top_k": r.top_k,
        "per_device_train_batch_size": micro_rows, "gradient_accumulation_steps": rows // micro_rows,
        "num_iterations": 1, "beta": a.kl_coef, "epsilon": a.clip_low, "epsilon_high": a.clip_high,
        "scale_rewards": "group" if a.normalize_std else "none", "loss_type": AGGREGATION_LOSS[a.aggregation],
    }


def job_rows(cfg, tokenizer, steps: int) -> list[dict]:
    """The rows TailSpec's run of `cfg` trains on in its first `steps` steps, in order: the prompt as
    TRL takes it (chat messages, or text), the gold answer, the prompt's token ids as TailSpec renders it."""
    from launch.run.problems import problems_for, prompt_loader
    from pipeline.rollout.stage import encode_problem

    problems = problems_for(cfg, tokenizer)
    loader = prompt_loader(cfg, problems.train)
    rows = []
    for step in range(steps):
        for p in loader.global_step(ahead=step + 1):
            prompt = [{"role": role, "content": text} for role, text in p.messages] if cfg.task.chat else p.prompt
            rows.append({"id": p.id, "prompt": prompt, "answer": p.answer,
                         "ids": encode_problem(tokenizer, p, cfg.task.chat)})
    return rows


def tailspec_figures(metrics: list[dict], rollouts: list[dict]) -> list[StepFigures]:
    """Per step from a run's metrics.jsonl step rows and rollouts.jsonl rows."""
    out = []
    for m in metrics:
        rows = [r for r in rollouts if r["step"] == m["step"]]
        parts = (m["timing/rollout"], m["timing/logprob"], m["timing/update"])
        out.append(StepFigures(step_s=m["timing/step"], generation_s=parts[0], logprob_s=parts[1], update_s=parts[2],
                               other_s=m["timing/step"] - sum(parts), tokens=sum(r["length"] for r in rows),
                               reward=m["reward/mean"]))
    return out


def trl_figures(result: dict) -> list[StepFigures]:
    """Per optimizer step from bench.trl_worker's result: the split from TRL's profiling spans in the step."""
    rewards = [h["reward"] for h in result["log_history"] if "reward" in h]
    out = []
    for i, s in enumerate(result["steps"]):
        spans = [(name, a, b) for name, a, b in result["spans"] if s["start"] <= a and b <= s["end"]]

        def total(suffix: str, inside: list | None = None) -> float:
            return sum(b - a for name, a, b in spans if name.endswith(suffix)
                       and (inside is None or any(x <= a and b <= y for x, y in inside)))

        prepare = [(a, b) for name, a, b in spans if name.endswith("._prepare_inputs")]
        generation = total(".transformers.generate")
        logprob = total("._get_per_token_logps_and_entropies", inside=prepare)
        prepare_s = sum(b - a for a, b in prepare)
        out.append(StepFigures(step_s=s["step_s"], generation_s=generation, logprob_s=logprob,
                               update_s=s["step_s"] - prepare_s, other_s=prepare_s - generation - logprob,
                               tokens=s["tokens"], reward=rewards[i] if i < len(rewards) else float("nan")))
    return out


def run_measured(cmd: list[str], env: dict, log: Path) -> tuple[float, int]:
    """Runs `cmd` in the repository root with its output in `log`; -> (wall seconds, peak RSS bytes).
    A failure raises RuntimeError with the log's end; an interrupt kills the process."""
    with open(log, "w") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}; the end of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    return time.perf_counter() - t, usage.ru_maxrss * 1024  # Linux reports kilobytes


def run_tailspec(config: str, overrides: list[str], steps: int, rows: list[dict], out: Path, env: dict) -> Side:
    from bench.runs import bench_overrides, read_metrics

    run_dir = out / "tailspec"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "launch.train", "--config", config, *bench_overrides(steps, overrides),
           f"run.dir={run_dir}"]
    wall, rss = run_measured(cmd, env, out / "tailspec.log")
    # The loop resets the kernel's high-water mark at each phase (pipeline.metrics.phase_peaks), so the
    # process's ru_maxrss at exit may miss an earlier phase's peak: the steps' logged peak covers it.
    logged = [r["memory/peak_rss_gb"] for r in read_metrics(run_dir) if "memory/peak_rss_gb" in r]
    rss = max([rss, *(int(gb * 1e9) for gb in logged)])
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    trained = sorted({(r["step"], r["prompt_id"]) for r in rollouts})
    per_step = len(rows) // steps
    expected = sorted({(1 + i // per_step, r["id"]) for i, r in enumerate(rows)})
    if trained != expected:
        raise RuntimeError(f"the TailSpec run trained on other prompts than the job's (rollouts.jsonl of {run_dir}): "
                           "the two sides would not run the same job")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final save: gigabytes nobody reads here
    return Side("TailSpec", tailspec_figures(read_metrics(run_dir), rollouts), rss, wall)


def run_trl(python: Path, job: dict, out: Path, env: dict) -> tuple[Side, dict]:
    job_file, result_file = out / "trl-job.json", out / "trl-result.json"
    job_file.write_text(json.dumps(job))
    wall, rss = run_measured([str(python), "-m", "bench.trl_worker", str(job_file), str(result_file)], env,
                             out / "trl.log")
    result = json.loads(result_file.read_text())
    return Side(f"TRL {result['versions']['trl']}", trl_figures(result), rss, wall), result


def print_table(sides: list[Side]) -> None:
    head = f"{'':>18}{'step s':>9}{'generate':>10}{'old lp':>8}{'update':>8}{'other':>8}{'tokens':>8}{'reward':>8}"
    print(head)
    for side in sides:
        for i, s in enumerate([*side.steps, side.mean]):
            label = f"{side.name} {'mean' if i == len(side.steps) else f'step {i + 1}'}"
            print(f"{label:>18}{s.step_s:>9.1f}{s.generation_s:>10.1f}{s.logprob_s:>8.1f}{s.update_s:>8.1f}"
                  f"{s.other_s:>8.1f}{s.tokens:>8d}{s.reward:>8.3f}")
        print(f"{side.name + ' peak RSS':>18}{side.peak_rss_bytes / 2**30:>9.2f} GiB   (process wall {side.wall_s:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trl", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2.yaml"), help="the TailSpec run config of the job")
    p.add_argument("--steps", type=int, default=3, help="RL steps (optimizer steps) of each side")
    p.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"),
                   help="TRL's interpreter (make setup-trl)")
    p.add_argument("--trl-micro-rows", type=int, default=8, help="TRL's rows a forward and backward "
                   "(per_device_train_batch_size; the step's rows / this = its gradient accumulation steps)")
    p.add_argument("--out", default=str(REPO / "runs" / "bench-trl"), help="folder of the runs' logs and metrics")
    p.add_argument("--json", action="store_true", help="a last line with the figures as one JSON object")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the config (both sides), e.g. rollout.n=4")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    python = Path(args.trl_python)
    if not python.is_file():
        raise FileNotFoundError(f"no TRL interpreter at {python}: run `make setup-trl` (it makes .venv-trl), or pass "
                                "--trl-python")
    from transformers import AutoTokenizer

    from bench.common import cpu_model, finish
    from common.config import load_config
    from launch.run.config import TrainConfig
    from pipeline.tasks.reward_plugins import math_verify_format_weight

    cfg = load_config(TrainConfig, args.config, args.overrides)
    settings = trl_settings(cfg, args.trl_micro_rows)
    rows = job_rows(cfg, AutoTokenizer.from_pretrained(cfg.model.path), args.steps)
    job = {"model": str(Path(cfg.model.path).resolve()), "steps": args.steps, "seed": cfg.run.seed, "rows": rows,
           "format_weight": math_verify_format_weight(cfg.task), "grpo": settings}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
           "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000"), "WANDB_MODE": "disabled"}
    r = cfg.rollout
    print(f"bench.trl: {cfg.algorithm.name} on {cfg.model.path}, {cfg.trainer.prompts_per_step} prompts x {r.n} "
          f"samples, {r.max_new_tokens} new tokens, T={r.temperature}, lr {cfg.actor.lr:g}, {args.steps} steps, one "
          f"process each; CPU: {cpu_model()}, {os.cpu_count()} cores", flush=True)
    tailspec = run_tailspec(args.config, args.overrides, args.steps, rows, out, env)
    trl, result = run_trl(python, job, out, env)
    print(f"TRL: {result['versions']}, {result['threads']} threads, {args.trl_micro_rows} rows a backward")
    print_table([trl, tailspec])
    ratio = trl.mean.step_s / tailspec.mean.step_s
    print(f"TailSpec's step is {ratio:.2f}x TRL's (mean step {trl.mean.step_s:.1f} s against {tailspec.mean.step_s:.1f} s)")
    finish({"ratio": round(ratio, 3), "steps": args.steps, "cpu_cores": os.cpu_count(),
            "sides": {s.name: {"steps": [asdict(x) for x in s.steps], "mean": asdict(s.mean),
                               "peak_rss_bytes": s.peak_rss_bytes, "wall_s": s.wall_s} for s in (trl, tailspec)},
            "trl_settings": settings}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
