"""Rewards in worker processes: each call runs once; a call that raises, hangs past its deadline or
kills its worker scores 0 and is counted, and the pool goes on with new workers; too many failures
stop the run naming task.max_reward_error_share and a failing row; no worker outlives the pool or
the run, and a real RL run with a flaky plug-in reward finishes with the counts in its metrics."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.tasks import TASKS
from pipeline.tasks.reward_plugins import BuiltinReward, PluginReward, TaskReward
from pipeline.tasks.reward_pool import InProcessRunner, RewardPool
from pipeline.tasks.reward_scoring import Rewards, RewardRow, RewardStats, reward_metrics
from pipeline.tasks.rewards import MathVerifyReward

REPO = Path(__file__).resolve().parent.parent

PLUGIN = """
import os, threading, time

def score(prompt, response, answer, extra):
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}} {{response}}\\n")
    if response == "raise":
        raise ZeroDivisionError("no score for " + prompt)
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(7)
    if response == "main":
        return float(threading.current_thread() is threading.main_thread())
    return {{"score": float(response == answer), "length": len(response)}}
"""


def children() -> set[int]:
    """The live child processes of this process (from /proc: reaped children are gone)."""
    me, found = str(os.getpid()), set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # it ended while we looked
            continue
        if fields.get("PPid", "").strip() == me:
            found.add(int(status.parent.name))
    return found


@pytest.fixture
def plugin(tmp_path) -> SimpleNamespace:
    """A plug-in that logs every call (pid, response) and raises, hangs, dies or scores by its response."""
    log = tmp_path / "calls.log"
    source = tmp_path / "test_plugin.py"
    source.write_text(PLUGIN.format(log=str(log)))
    return SimpleNamespace(reward=PluginReward(f"{source}:score"),
                           calls=lambda: [line.split(" ", 1) for line in log.read_text().splitlines()] if log.exists() else [])


def args(*responses: str) -> list[tuple]:
    return [("2+2?", r, "4", {}) for r in responses]


def test_each_call_runs_once_and_raising_hanging_or_dying_fails_only_that_call(plugin):
    before = children()
    pool = RewardPool([plugin.reward], workers=2, timeout_s=0.5)
    try:
        first = set(pool.pids)
        assert children() - before == first
        out = pool.run(0, args("4", "raise", "hang", "5", "die", "4", "main"))
        assert [o.value for o in out] == [{"score": 1.0, "length": 1}, None, None, {"score": 0.0, "length": 1}, None,
                                          {"score": 1.0, "length": 1}, 1.0]  # 1.0: a worker calls in its main thread
        assert out[1].error.startswith("ZeroDivisionError: no score for 2+2? (at ") and "test_plugin.py:" in out[1].error
        assert out[2].timed_out and out[2].error is None
        assert out[4].error == "the reward worker died (exit code 7) while running it"
        assert sorted(r for _, r in plugin.calls()) == sorted(["4", "raise", "hang", "5", "die", "4", "main"])
        assert len(set(pool.pids) & first) == 0  # the hung worker and the dead one were replaced by new ones
        assert not any(o.failed for o in pool.run(0, args("4", "4", "4")))
    finally:
        pool.close()
    assert children() == before


def test_a_pool_whose_workers_all_died_starts_new_ones_and_loses_no_call(plugin):
    pool = RewardPool([plugin.reward], workers=2, timeout_s=5.0)
    try:
        old = pool.pids
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        for pid in old:  # until each has exited (left unreaped for the pool to see)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        out = pool.run(0, args("4", "5", "4", "4"))
        assert [o.value["score"] for o in out] == [1.0, 0.0, 1.0, 1.0]
        assert len(plugin.calls()) == 4 and not set(pool.pids) & set(old)
    finally:
        pool.close()


def test_math_verify_in_a_worker_keeps_its_signal_timeouts(plugin):
    pool = RewardPool([plugin.reward, BuiltinReward(MathVerifyReward(format_weight=0.5))], workers=1, timeout_s=30.0)
    try:
        main, math = pool.run(0, args("main"))[0], pool.run(1, [("q", "so \\boxed{\\frac{14}{2}}", "7", {})])[0]
    finally:
        pool.close()
    assert main.value == 1.0  # the main thread, where math-verify's signal.alarm works
    assert math.value == {"score": 1.5, "correct": 1.0, "boxed": 1.0}


def test_a_reward_that_cannot_be_pickled_is_refused_naming_task_reward_workers():
    with pytest.raises(ValueError, match=r"cannot be sent to reward worker processes .* task.reward_workers=0"):
        RewardPool([TaskReward(lambda response, answer: 1.0, "a lambda")], workers=1, timeout_s=1.0)


def test_a_reward_that_loads_here_but_not_in_a_worker_fails_at_construction_and_leaves_no_worker(tmp_path):
    source = tmp_path / "parent_only.py"
    source.write_text(f"import os\nif os.getpid() != {os.getpid()}:\n    raise ImportError('only in the parent')\n"
                      "def score(prompt, response, answer, extra):\n    return 1.0\n")
    before = children()
    with pytest.raises(ValueError, match=r"(?s)a reward worker could not load the reward:.*ImportError: only in the parent"):
        RewardPool([PluginReward(f"{source}:score")], workers=2, timeout_s=1.0)
    assert children() == before


def rows(*responses: str) -> list[RewardRow]:
    return [RewardRow(prompt_id=f"p{i}", sample=i % 2, prompt="2+2?", response=r, answer="4") for i, r in enumerate(responses)]


def flaky(response: str, answer: str) -> float:
    if response == "raise":
        raise KeyError("missing")
    return float(response == answer)


def test_failed_calls_score_0_are_counted_and_the_first_few_are_logged():
    logged: list[str] = []
    fn = TaskReward(flaky, "flaky")
    rewards = Rewards(fn, fn, InProcessRunner([fn, fn]), max_error_share=0.9, timeout_s=None, log=logged.append)
    assert rewards.score(rows("4", "raise", "5", "raise"), step=2) == [1.0, 0.0, 0.0, 0.0]
    assert logged[0].startswith("reward flaky failed at step 3 on prompt 'p1' sample 1 (scored 0): KeyError: 'missing' (at ")
    assert "the response begins 'raise'" in logged[0]
    rewards.score(rows(*["raise"] * 5, "4"), step=3)
    assert len(logged) == 6 and "later reward failures are counted" in logged[-1]  # 5 failures, then the note
    stats = rewards.take_stats()
    assert (stats.calls, stats.errors, stats.timeouts) == (10, 7, 0)
    assert rewards.take_stats() == RewardStats()


def test_more_failures_than_the_share_stop_with_the_key_and_a_failing_row():
    fn = TaskReward(flaky, "flaky")
    rewards = Rewards(fn, fn, InProcessRunner([fn, fn]), max_error_share=0.25, timeout_s=None, log=lambda _: None)
    rewards.score(rows("raise", "4", "4", "4"), step=0)  # 25%: at the share, not above it
    with pytest.raises(ValueError, match=r"reward flaky: 2 of 4 calls failed at step 2 on this rank \(2 raised, 0 timed "
                                         r"out\), 50.0%, above task.max_reward_error_share=0.25; one failing row: prompt "
                                         r"id 'p1' sample 1: KeyError: 'missing' \(at .*test_reward_pool.py:\d+ in flaky\)"):
        rewards.score(rows("4", "raise", "raise", "4"), step=1)


def test_held_out_scores_use_the_held_out_reward_and_stay_out_of_the_steps_counts():
    train = TaskReward(lambda response, answer: 1.5, "with a bonus")
    held_out = TaskReward(flaky, "correctness")
    logged: list[str] = []
    rewards = Rewards(train, held_out, InProcessRunner([train, held_out]), max_error_share=0.5, timeout_s=None,
                      log=logged.append)
    assert rewards.score_held_out(rows("4", "raise", "5")) == [1.0, 0.0, 0.0]
    assert rewards.score(rows("4"), step=0) == [1.5]
    assert rewards.take_stats().calls == 1
    assert logged[-1] == "held-out evaluation: 1 reward call(s) raised and 0 timed out, of 3; each scored 0"


def test_step_metrics_sum_the_counts_over_ranks_and_average_a_plugins_metrics_over_its_calls():
    ranks = [RewardStats(calls=4, errors=1, timeouts=0, sums={"length": 6.0}, counts={"length": 3}),
             RewardStats(calls=4, errors=0, timeouts=2, sums={"length": 2.0, "format": 1.0}, counts={"length": 2, "format": 2})]
    assert reward_metrics(ranks) == {"reward/errors": 1.0, "reward/timeouts": 2.0, "reward/length": 8.0 / 5,
                                     "reward/format": 0.5}


def test_a_reward_that_does_not_load_stops_the_build_before_the_engine(char_model_dir, tmp_path, monkeypatch):
    from launch.run.build import run
    from pipeline.dist import Ranks

    monkeypatch.setattr("launch.run.parts.build_rollout_engine", lambda *a, **k: pytest.fail("the engine was built"))
    with pytest.raises(ValueError, match=r"task.reward=nowhere/reward.py:score: no file"):
        run(run_config(char_model_dir, tmp_path, "task.reward=nowhere/reward.py:score"), Ranks())


FLAKY = """
import fcntl, time

def score(prompt, response, answer, extra):
    with open({log!r}, "a+") as f:  # numbers the calls of the run, over its worker processes
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read().splitlines())
        what = "raise" if k % 10 == 9 else "hang" if k % 20 == 14 else "ok"  # 10% raise, 5% hang
        f.write(what + "\\t" + prompt.replace("\\n", " ") + "\\n")
    if what == "raise":
        raise ZeroDivisionError("no score")
    if what == "hang":
        time.sleep(60)
    return {{"score": sum(c.isdigit() for c in response) / max(len(response), 1), "length": len(response)}}
"""


def run_config(model_dir: Path, out: Path, *overrides: str):
    from common.config import load_config
    from launch.run.config import TrainConfig

    base = [f"model.path={model_dir}", f"run.out_dir={out}", "task.name=arith", "task.train_problems=64",
            "task.eval_problems=4", "task.eval_max_new_tokens=24", "rollout.n=4", "rollout.max_new_tokens=24",
            "engine.max_batch=16", "engine.max_len=96", "engine.spec.enabled=false", "trainer.steps=3",
            "trainer.prompts_per_step=4", "trainer.mini_batches=2", "trainer.eval_every=0", "trainer.train_shares=shard",
            "rollout.split_groups=false", "actor.lr=1e-3", "actor.micro_batch_tokens=256", "metrics.wandb=false",
            "metrics.console=false", "metrics.dashboard=false", "spot.enabled=false"]
    return load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*base, *overrides])


@pytest.mark.slow
def test_a_run_with_a_flaky_plugin_finishes_with_the_counts_and_stops_past_the_share(char_model_dir, tmp_path):
    from launch.run.build import run
    from pipeline.dist import Ranks
    from pipeline.tasks.eval import EVAL_SEED

    log = tmp_path / "calls.tsv"
    source = tmp_path / "flaky_reward.py"
    source.write_text(FLAKY.format(log=str(log)))
    flags = [f"task.reward={source}:score", "task.reward_timeout_s=0.5", "task.reward_workers=2"]
    before = children()
    summary = run(run_config(char_model_dir, tmp_path / "ok", *flags, "task.max_reward_error_share=0.5"), Ranks())
    assert children() == before  # the run closed its pool
    held_out = {p.prompt.replace("\n", " ") for p in TASKS["arith"].make_problems("test", 4, EVAL_SEED)}
    calls = [line.split("\t", 1) for line in log.read_text().splitlines()]
    training = [what for what, prompt in calls if prompt not in held_out]
    assert len(training) == 3 * 4 * 4 and len(calls) - len(training) == 2 * 4  # once per rollout; two evaluations
    steps = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    counts = [(s["reward/errors"], s["reward/timeouts"]) for s in steps if "timing/step" in s]
    # calls 0-3 are the first evaluation's, then 16 a step: 9 and 19 raise and 14 hangs in step 1; 29 raises and
    # 34 hangs in step 2; 39 and 49 raise in step 3
    assert counts == [(2, 1), (1, 1), (2, 0)]
    assert sum(e for e, _ in counts) == training.count("raise") and sum(h for _, h in counts) == training.count("hang")
    assert all(s["reward/length"] > 0 for s in steps if "timing/step" in s)

    log.unlink()
    with pytest.raises(ValueError, match=r"flaky_reward.py:score: 3 of 16 calls failed at step 1 on this rank \(2 raised, 1 "
                                         r"timed out\), 18.8%, above task.max_reward_error_share=0.05; one failing row: "
                                         r"prompt id 'arith-train-\d+' sample \d: ZeroDivisionError: no score \(at "
                                         r".*flaky_reward.py:\d+ in score\)"):
        run(run_config(char_model_dir, tmp_path / "stop", *flags, "task.max_reward_error_share=0.05"), Ranks())
    assert children() == before  # the failed run closed its pool too


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["separated", "colocated"])
def test_under_torchrun_the_counts_reach_the_metrics_from_every_rank_that_scores(placement, char_model_dir, tmp_path):
    from tests.test_separated import separated, step_rows, torchrun

    log = tmp_path / "calls.tsv"
    source = tmp_path / "flaky_reward.py"
    source.write_text(FLAKY.format(log=str(log)))
    layout = separated(1) if placement == "separated" else []  # 1 actor and 1 rollout rank, or 2 colocated ranks
    torchrun(2, tmp_path / "run", *layout, f"model.path={char_model_dir}", "trainer.steps=2", "engine.spec.enabled=false", f"task.reward={source}:score",
             "task.reward_timeout_s=0.5", "task.max_reward_error_share=0.9")
    calls = [line.split("\t", 1)[0] for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 4 * 4 + 2 * 4  # every rollout once, and two evaluations of 4 problems
    counts = [(s["reward/errors"], s["reward/timeouts"]) for s in step_rows(tmp_path / "run")]
    if placement == "separated":  # one rank scores, in order: calls 0-3 evaluate, 9 and 19 raise, 14 and 34 hang
        assert counts == [(2, 1), (1, 1)]
    training = calls[4:-4]  # between the evaluation before the first step and the one after the last
    # summed over ranks: every failure of a training call, wherever it ran
    assert (sum(e for e, _ in counts), sum(h for _, h in counts)) == (training.count("raise"), training.count("hang"))
