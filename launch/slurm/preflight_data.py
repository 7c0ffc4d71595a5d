"""The preflight's checks of what a run reads before its first rollout: the held-out file and the reward.

Inside the job these would fail only after the queue wait, at build time. Here, on the login node:
- `eval file`: task.eval_file is read with the task's fields (and task.max_bad_share), as the run
  reads it;
- `reward`: task.reward is loaded (a file that does not import, a missing function, a signature of
  no convention: pipeline.tasks.reward_plugins), then scores the first SCORED_ROWS problems of the
  training data (task.file's, or the task's generated ones) in a reward worker with the run's
  deadline (task.reward_timeout_s), as the run calls it: each row's reference response where it has
  one, else a response that puts the row's answer in `\\boxed{}` (what the math instruction asks
  for). A call that raises, times out or returns no finite score fails the check, naming the row.
  The scores are shown, since a reward that gives 0 to a correct answer is worth a look before a run.
"""

from __future__ import annotations

from pathlib import Path

from launch.run.config import TrainConfig
from launch.slurm.check import Check
from pipeline.data.files import RowFields, load_problems
from pipeline.tasks import Problem, get_task
from pipeline.tasks.reward_plugins import reward_functions
from pipeline.tasks.reward_pool import InProcessRunner, RewardPool
from pipeline.tasks.reward_scoring import RewardRow, read_result

SCORED_ROWS = 4


def data_checks(cfg: TrainConfig, missing: list[str]) -> list[Check]:
    checks = []
    if cfg.task.eval_file and "task.eval_file" not in missing:
        checks.append(_eval_file(cfg))
    if "task.file" not in missing and not (cfg.task.file and not Path(cfg.task.file).is_file()):
        checks.append(_reward(cfg))
    return checks


def _fields(cfg: TrainConfig) -> RowFields:
    t = cfg.task
    return RowFields(prompt=t.prompt_field, answer=t.answer_field, id=t.id_field, response=t.response_field)


def _eval_file(cfg: TrainConfig) -> Check:
    path = cfg.task.eval_file
    fix = ("set task.eval_file to a JSONL / JSON / parquet of held-out problems with the fields task.prompt_field / "
           "task.answer_field, or null to hold out task.eval_share of task.file")
    try:
        problems, report = load_problems(path, _fields(cfg), max_bad_share=cfg.task.max_bad_share)
    except FileNotFoundError as e:
        return Check("eval file", False, f"task.eval_file={path}: {e}", fix)
    except ValueError as e:
        return Check("eval file", False, f"task.eval_file={path}: {e}", fix)
    bad = f", {len(report.bad)} malformed rows skipped" if report.bad else ""
    return Check("eval file", True, f"{path}: {len(problems)} problems{bad} (task.eval_problems={cfg.task.eval_problems} "
                 "evaluated)")


def _sample(cfg: TrainConfig) -> list[Problem]:
    if cfg.task.file:
        problems, _ = load_problems(cfg.task.file, _fields(cfg), max_bad_share=1.0)
        return problems[:SCORED_ROWS]
    return get_task(cfg.task.name).make_problems("train", SCORED_ROWS, cfg.run.seed)


def _reward(cfg: TrainConfig) -> Check:
    t = cfg.task
    fix = "fix the reward, or task.reward (docs/ARCHITECTURE.md, 'Rewards')"
    try:
        train, _ = reward_functions(t, get_task(t.name))
        problems = _sample(cfg)
    except ValueError as e:
        return Check("reward", False, str(e), fix)
    rows = [RewardRow(prompt_id=p.id, sample=0, prompt=p.prompt, answer=p.answer, extra=p.extra,
                      response=p.response or f"The answer is \\boxed{{{p.answer}}}.") for p in problems]
    pooled = t.reward is not None and t.reward_workers > 0
    try:
        runner = RewardPool([train], 1, t.reward_timeout_s) if pooled else InProcessRunner([train])
    except (ValueError, RuntimeError) as e:
        return Check("reward", False, f"{train.name} does not load in a reward worker: {e}", fix)
    try:
        outcomes = runner.run(0, [(r.prompt, r.response, r.answer, dict(r.extra)) for r in rows])
    finally:
        runner.close()
    scores = []
    for row, outcome in zip(rows, outcomes):
        if outcome.failed:
            what = f"ran past task.reward_timeout_s={t.reward_timeout_s}" if outcome.timed_out else outcome.error
            return Check("reward", False, f"{train.name} failed on row {row.prompt_id!r}: {what}", fix)
        try:
            scores.append(read_result(train, outcome.value, row)[0])
        except ValueError as e:
            return Check("reward", False, str(e), fix)
    where = f"in a reward worker, at most {t.reward_timeout_s:g} s a call" if pooled else "in this process"
    shown = ", ".join(f"{s:g}" for s in scores)
    return Check("reward", True, f"{train.name} scored {len(rows)} rows of the training data {where}: {shown} (each row's "
                 "reference response, else its answer in \\boxed{})")
