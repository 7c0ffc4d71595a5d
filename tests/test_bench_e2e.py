"""bench.e2e: the ceiling and the summary over steps on hand-built rows, the levers a config gives,
bad input named, and whole runs on the char model that are the same run every way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import e2e
from bench.e2e import WayTimes, ceiling, headline, levers
from common.config import load_config
from launch.run.config import TrainConfig
from pipeline.tasks import TASKS, Task, arith
from tests.conftest import digit_share

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.yaml")


def row(step: float, rollout: float, idle: float = 0.0, accept: float | None = None) -> dict:
    m = {"timing/step": step, "timing/rollout": rollout, "timing/idle": idle, "timing/logprob": 0.0,
         "timing/update": step - rollout - idle, "timing/sync": 0.0}
    return m if accept is None else {**m, "spec/accept_len": accept}


def times(step: float, rollout: float, accept: float | None = None, r_gen: float | None = None) -> WayTimes:
    return WayTimes(step_s=step, rollout_s=rollout, idle_s=0.0, logprob_s=0.0, update_s=step - rollout, sync_s=0.0,
                    accept_len=accept, r_gen=rollout / step if r_gen is None else r_gen, idle_share=0.0)


def test_the_ceiling_is_one_without_faster_rollouts_and_alpha_when_the_rollout_is_the_whole_step():
    assert ceiling(0.6, 1.0) == pytest.approx(1.0)
    assert ceiling(1.0, 4.0) == pytest.approx(4.0)
    assert ceiling(0.5, 2.0) == pytest.approx(1 / (0.25 + 0.5))
    assert ceiling(0.8, 1e9) == pytest.approx(5.0)  # free rollouts: 1 / (1 - R_gen)
    with pytest.raises(ValueError, match="R_gen"):
        ceiling(1.2, 2.0)


def test_a_way_is_summarised_over_steps_two_to_n_with_per_step_shares():
    rows = [row(100.0, 90.0, accept=9.0), row(2.0, 1.0, idle=0.5, accept=2.0), row(4.0, 3.0, idle=0.0)]
    w = WayTimes.of(rows)
    assert w.step_s == pytest.approx(3.0) and w.rollout_s == pytest.approx(2.0) and w.idle_s == pytest.approx(0.25)
    assert w.r_gen == pytest.approx((1.5 / 2 + 3 / 4) / 2)  # rollout + idle: each step's share, not a ratio of means
    assert w.gen_s == pytest.approx(2.25)
    assert w.idle_share == pytest.approx((0.25 + 0.0) / 2)
    assert w.accept_len == pytest.approx(2.0)  # step 1's 9.0 excluded; step 3 speculated nowhere
    assert WayTimes.of([row(1.0, 0.5), row(1.0, 0.5)]).accept_len is None
    with pytest.raises(ValueError, match="two or more steps"):
        WayTimes.of([row(1.0, 0.5)])


def test_rounds_of_a_way_are_pooled_step_by_step_each_without_its_first_step():
    first, second = [row(50.0, 40.0), row(2.0, 1.0)], [row(60.0, 50.0), row(4.0, 1.0), row(6.0, 3.0)]
    w = WayTimes.of(first, second)
    assert w.step_s == pytest.approx((2.0 + 4.0 + 6.0) / 3) and w.rollout_s == pytest.approx(5.0 / 3)


def test_the_headline_divides_all_off_by_each_way_and_is_identical_only_if_every_pair_is():
    ways = {"all-off": times(10.0, 6.0), "as-shipped": times(8.0, 4.0, accept=3.0), "spec": times(5.0, 2.0, accept=3.0)}
    out = headline(ways, {"as-shipped": True, "spec": True})
    assert out["step_ratio"] == 1.25 and out["rollout_ratio"] == 1.5 and out["accept_len"] == 3.0
    assert out["r_gen"] == 0.6 and out["ceiling"] == round(1 / (0.6 / 3 + 0.4), 3)
    assert out["of_ceiling"] == round(1.25 / (1 / (0.6 / 3 + 0.4)), 3)
    # the generation phase 1.5x faster (6 s -> 4 s): 1 / (0.6 / 1.5 + 0.4), which the step ratio meets
    assert out["rollout_bound"] == 1.25 and out["of_rollout_bound"] == 1.0
    assert out["levers"] == {"spec": {"step_ratio": 2.0, "rollout_ratio": 3.0, "accept_len": 3.0, "identical": True}}
    assert out["identical"] is True
    assert headline(ways, {"as-shipped": True, "spec": False})["identical"] is False
    assert headline({**ways, "as-shipped": times(8.0, 4.0)}, {"as-shipped": True, "spec": True})["ceiling"] == 1.0


def test_each_lever_is_added_alone_to_all_off_and_those_that_cannot_run_say_why():
    cfg = load_config(TrainConfig, TINY, ["engine.spec.drafter=pregenerated+eagle", "engine.spec.tuner_arms=[]"])
    by_name = {lever.name: lever for lever in levers(cfg, world=2)}
    assert list(by_name) == ["spec", "tuner", "spot", "bubble", "steal", "split", "long_first", "history", "das"]
    assert not any(lever.skip for lever in by_name.values() if lever.name != "das")
    assert set(by_name["steal"].overrides) == {"rollout.work_stealing=true", "rollout.long_first=true"}
    assert by_name["split"].overrides == ("rollout.split_groups=true",)
    assert "maximum depth 16" in by_name["das"].skip  # the fixed depth-16 chain has no deeper budget
    assert "engine.spec.drafter=eagle" in by_name["spec"].overrides and "engine.spec.tuner_arms=[]" in by_name["spec"].overrides
    assert 'engine.spec.tuner_arms=["off", "d4k1v4", "d8k1v8", "d16k1v16"]' in by_name["tuner"].overrides
    assert "default set" in by_name["tuner"].note
    assert {"engine.spec.drafter=eagle", "spot.enabled=true"} <= set(by_name["spot"].overrides)
    assert {"engine.spec.drafter=pregenerated+eagle", "bubble.enabled=true"} <= set(by_name["bubble"].overrides)
    assert "engine.spec.drafter=history+eagle" in by_name["history"].overrides
    assert "prompts recur from step 17" in by_name["history"].note  # 256 problems, 16 a step
    shipped = {lever.name: lever for lever in levers(load_config(TrainConfig, TINY, []), world=2)}
    assert 'engine.spec.tuner_arms=["off", "d4k1v4", "d8k1v8", "d16k1v16", "d4k1v4L16", "d8k1v8L16"]' in shipped["das"].overrides
    fixed8 = load_config(TrainConfig, TINY, ["engine.spec.tuner_arms=[]", "engine.spec.depth=8", "engine.spec.verify_tokens=8"])
    das8 = next(lever for lever in levers(fixed8, world=2) if lever.name == "das")
    assert das8.skip is None and "engine.spec.long_depth=16" in das8.overrides
    alone = {lever.name: lever.skip for lever in levers(cfg, world=1)}
    assert alone["spec"] is None and alone["tuner"] is None and "two or more ranks" in alone["spot"] and alone["bubble"]
    assert "two or more ranks" in alone["steal"] and "two or more ranks" in alone["split"] and alone["long_first"] is None
    ngram = load_config(TrainConfig, TINY, ["engine.spec.drafter=ngram", 'engine.spec.tuner_arms=["off", "d2k1v2"]',
                                            "engine.spec.max_active_batch=null"])
    by_name = {lever.name: lever for lever in levers(ngram, world=2)}
    assert "learned drafter" in by_name["spot"].skip and by_name["bubble"].skip is None
    assert 'engine.spec.tuner_arms=["off", "d2k1v2"]' in by_name["tuner"].overrides and by_name["tuner"].note == ""


@pytest.mark.parametrize("argv, message", [
    (["--levers", "spec,spto"], "unknown lever 'spto' (did you mean 'spot'?)"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--config", "configs/nope.yaml"], "config file not found"),
    (["trainer.stepz=3"], "trainer.stepz"),
])
def test_bad_input_is_refused_naming_what_is_wrong(argv, message, tmp_path, capsys):
    assert e2e.main(["--config", TINY, "--out", str(tmp_path), *argv]) == 1
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any run


def small(char_model_dir, char_drafter_dir, task: str) -> list[str]:
    return [f"model.path={char_model_dir}", f"engine.spec.drafter_path={char_drafter_dir}", f"task.name={task}",
            "task.train_problems=64", "task.eval_problems=2", "rollout.n=4", "rollout.max_new_tokens=24", "engine.max_batch=16",
            "engine.max_len=96", "trainer.prompts_per_step=4", "trainer.mini_batches=2", "actor.lr=1e-3",
            "actor.micro_batch_tokens=256", "engine.spec.depth=4", "engine.spec.verify_tokens=4",
            "engine.spec.max_active_batch=null", "engine.spec.tuner_arms=[]"]


def test_step_ratios_pair_the_same_steps_and_leave_out_step_1():
    off = [{"timing/step": 9.0}, {"timing/step": 4.0}, {"timing/step": 6.0}]
    way = [{"timing/step": 3.0}, {"timing/step": 2.0}, {"timing/step": 8.0}]
    assert e2e.step_ratios(off, way) == [2.0, 0.75]


@pytest.mark.slow
def test_every_lever_alone_and_as_shipped_is_the_all_off_run_and_the_json_says_so(char_model_dir, char_drafter_dir, tmp_path,
                                                                                   capsys, monkeypatch):
    monkeypatch.setitem(TASKS, "digits", Task(name="digits", make_problems=arith.make_problems, reward=digit_share))
    png = tmp_path / "split.png"
    rc = e2e.main(["--config", TINY, "--steps", "2", "--levers", "spec,tuner,spot", "--out", str(tmp_path / "runs"),
                   "--plot", str(png), "--json", *small(char_model_dir, char_drafter_dir, "digits")])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert rc == 0, captured.err[-3000:]
    keys = {"step_ratio", "rollout_ratio", "r_gen", "accept_len", "ceiling", "identical", "idle_share",
            "update_skipped_share", "levers", "cpu"}
    assert keys <= out.keys()
    assert 0 <= out["update_skipped_share"] < 1
    assert out["identical"] is True and out["identical_ways"] == {"as-shipped": True, "spec": True, "tuner": True}
    assert set(out["levers"]) == {"spec", "tuner"}
    assert all(set(v) == {"step_ratio", "rollout_ratio", "accept_len", "identical"} for v in out["levers"].values())
    assert "two or more ranks" in out["skipped"]["spot"]  # one process: no idle windows
    assert out["accept_len"] >= 1 and 0 < out["r_gen"] < 1 and out["ceiling"] >= 1
    assert "default set off,d1k1v1,d2k1v2,d4k1v4" in out["notes"]["tuner"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "identical runs: True" in captured.err


@pytest.mark.slow
def test_repeated_rounds_are_each_the_all_off_run_and_report_the_ratio_of_every_round(char_model_dir, char_drafter_dir,
                                                                                       tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(TASKS, "digits", Task(name="digits", make_problems=arith.make_problems, reward=digit_share))
    rc = e2e.main(["--config", TINY, "--steps", "2", "--levers", "spec", "--repeats", "2", "--out", str(tmp_path), "--json",
                   *small(char_model_dir, char_drafter_dir, "digits")])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert rc == 0, captured.err[-3000:]
    assert out["identical_ways"] == {"all-off": True, "as-shipped": True, "spec": True}  # all-off's second round too
    assert set(out["runs"]) == {"all-off", "as-shipped", "spec", "all-off@2", "as-shipped@2", "spec@2"}
    assert out["repeats"] == 2 and len(out["step_ratio_by_round"]) == 2 and all(x > 0 for x in out["step_ratio_by_round"])
    assert len(out["step_ratios"]) == 2  # step 2 of each round
    assert out["worst_step_ratio"] == min(out["step_ratios"])
    assert "by round" in captured.err and "worst step" in captured.err


@pytest.mark.slow
def test_a_way_that_learns_another_run_is_caught_and_exits_2(char_model_dir, char_drafter_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(TASKS, "digits", Task(name="digits", make_problems=arith.make_problems, reward=digit_share))
    real = e2e.levers
    monkeypatch.setattr(e2e, "levers", lambda cfg, world: [replace(lever, overrides=(*lever.overrides, "actor.lr=3e-3"))
                                                           for lever in real(cfg, world)])
    rc = e2e.main(["--config", TINY, "--steps", "2", "--levers", "spec", "--out", str(tmp_path), "--json",
                   *small(char_model_dir, char_drafter_dir, "digits")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and out["identical"] is False
    assert out["identical_ways"] == {"as-shipped": True, "spec": False} and out["levers"]["spec"]["identical"] is False


@pytest.mark.slow
def test_under_torchrun_spot_training_and_bubble_drafts_alone_are_the_all_off_run(char_model_dir, char_drafter_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bench.e2e",
           "--config", TINY, "--steps", "2", "--levers", "spot,bubble", "--out", str(tmp_path), "--json",
           *small(char_model_dir, char_drafter_dir, "arith")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["world_size"] == 2 and out["skipped"] == {}
    assert out["identical_ways"] == {"as-shipped": True, "spot": True, "bubble": True}


def test_a_finished_runs_memory_in_reference_cycles_is_handed_back_before_the_next_way():
    """bench.runs.release_heap: tensors a run left in reference cycles are freed and the heap trimmed."""
    import torch

    from bench.runs import release_heap

    def rss_mb() -> float:
        return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1e3

    class Part:  # a part that refers to itself, as a run's parts do through their hooks
        def __init__(self):
            self.me, self.weights = self, torch.ones(50_000_000)  # 200 MB, touched

    release_heap()
    before = rss_mb()
    Part()
    held = rss_mb()
    assert held - before > 150  # the cycle still holds it: reference counting alone frees nothing
    release_heap()
    assert rss_mb() - before < 50
