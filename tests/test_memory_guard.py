"""The memory guard's decisions (pure) and what shedding does to the idle work: optional work is shed
once, before the run stops; a host running out stops the run; each mode does what it says."""

from __future__ import annotations

import pytest
import torch

from common.idle import IdleSchedule, ScheduledIdle
from pipeline.hooks import IdleWorkHook, StepHook
from pipeline.memory_guard import Action, MemoryGuard, MemoryGuardConfig, available_share
from tests.test_idle_schedule import ClockTraining, FakeClock, bubble, window
from tests.test_trainer import digits_task  # noqa: F401 (a fixture)


def guard(mode="shed", planned=(8.0, 8.0), **kw) -> MemoryGuard:
    kw = {"over_plan": 0.15, "over_plan_gb": 0.5} | kw
    return MemoryGuard(MemoryGuardConfig(mode=mode, **kw), planned, log=lambda msg: None)


def test_by_default_a_rank_may_run_a_third_over_its_plan_as_glibcs_heap_makes_it():
    default = MemoryGuard(MemoryGuardConfig(), [7.5], log=lambda msg: None)
    assert default.verdict([9.9], [0.5], can_shed=True).action is Action.NONE  # the GSM8K recipe's rank 0, +32%
    assert default.verdict([12.9], [0.5], can_shed=True).action is Action.SHED  # with bubble drafts' 3-5 GB


def test_within_the_plan_and_with_memory_available_nothing_happens():
    assert guard().verdict([9.1, 8.0], [0.5, 0.5], can_shed=True).action is Action.NONE  # 9.1 < 8 x 1.15


def test_a_rank_over_its_plan_sheds_optional_work_naming_the_rank_and_the_figures():
    v = guard().verdict([8.0, 9.5], [0.5, 0.5], can_shed=True)
    assert v.action is Action.SHED
    assert "rank 1 peaked at 9.50 GB" in v.reason and "8.00 GB" in v.reason and "over_plan=0.15" in v.reason


def test_over_the_plan_with_nothing_left_to_shed_is_logged_once_and_the_run_goes_on():
    g = guard()
    g.shed_done = True
    assert g.verdict([9.5, 9.5], [0.5, 0.5], can_shed=True).action is Action.WARN
    assert g.verdict([9.6, 9.6], [0.5, 0.5], can_shed=True).action is Action.NONE  # said once
    assert guard().verdict([9.5, 9.5], [0.5, 0.5], can_shed=False).action is Action.WARN


def test_a_host_running_out_sheds_first_then_stops():
    g = guard()
    first = g.verdict([8.0, 8.0], [0.5, 0.03], can_shed=True)
    assert first.action is Action.SHED and "rank 1's host has 3.0%" in first.reason
    g.shed_done = True
    assert g.verdict([8.0, 8.0], [0.5, 0.03], can_shed=True).action is Action.STOP
    assert guard().verdict([8.0, 8.0], [0.02, 0.5], can_shed=False).action is Action.STOP


def test_stop_mode_stops_at_either_condition_and_warn_mode_never_acts():
    assert guard("stop").verdict([9.5, 8.0], [0.5, 0.5], can_shed=True).action is Action.STOP
    assert guard("stop").verdict([8.0, 8.0], [0.01, 0.5], can_shed=True).action is Action.STOP
    g = guard("warn")
    assert g.verdict([9.5, 8.0], [0.01, 0.5], can_shed=True).action is Action.WARN
    assert g.verdict([9.5, 8.0], [0.01, 0.5], can_shed=True).action is Action.NONE
    assert guard("off").verdict([99.0, 99.0], [0.0, 0.0], can_shed=True).action is Action.NONE


def test_a_small_plan_is_held_to_an_absolute_margin_too():
    assert guard(planned=(0.40,)).verdict([0.49], [0.5], can_shed=True).action is Action.NONE  # +22%, 0.09 GB
    assert guard(planned=(0.40,)).verdict([0.95], [0.5], can_shed=True).action is Action.SHED


def test_without_a_plan_only_the_hosts_available_memory_counts():
    g = guard(planned=None)
    assert g.verdict([99.0], [0.5], can_shed=True).action is Action.NONE
    assert g.verdict([99.0], [0.01], can_shed=True).action is Action.SHED


def test_the_stop_message_names_the_checkpoint_step_and_the_knobs():
    msg = guard().stop_message("rank 0 peaked at 12.00 GB", step=7)
    assert "after step 7" in msg and "actor.micro_batch_tokens" in msg and "trainer.resume" in msg


@pytest.mark.parametrize("key,value", [("over_plan", -0.1), ("over_plan_gb", -1.0), ("min_available", 1.0)])
def test_bad_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"memory_guard.{key}"):
        MemoryGuardConfig(**{key: value}).validate()


def test_the_hosts_available_share_is_read_from_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    250 kB\n")
    assert available_share(tmp_path / "meminfo") == 0.25
    assert 0 < available_share() <= 1


def test_shed_idle_work_stops_both_works_frees_the_drafts_and_keeps_their_state():
    clock = FakeClock()
    pregen, train = bubble(clock), ClockTraining(clock, step_s=0.5)
    idle = ScheduledIdle(IdleSchedule(pregenerate=True, train=True, share=0.5), pregen, train)
    idle.work(window(clock, length=10.0, expected=10.0))
    assert pregen.store.drafts and len(train.micro_steps) == 1
    hook = IdleWorkHook(idle)
    assert hook.optional and not StepHook().optional
    assert hook.shed() == ["bubble drafts", "spot training"]
    assert not pregen.store.drafts  # released
    assert idle.work(window(clock, length=10.0, expected=10.0)) == {} and len(train.micro_steps) == 1
    assert hook.shed() == []  # once
    assert set(idle.state_dict()) == {"bubble", "spot"}  # still checkpointed


def test_a_host_running_out_stops_the_run_with_a_checkpoint_that_resumes_to_the_same_run(char_model_dir, digits_task, tmp_path):
    from launch.run.build import run
    from pipeline.dist import Ranks
    from pipeline.memory_guard import MemoryGuardStop
    from tests.test_trainer import LEARNED, config, step_rows, weights

    out, plain = tmp_path / "cut", ("engine.spec.enabled=false",)
    # Every host has less than 99.99% of its memory available: the guard stops after step 1, with
    # nothing optional to shed on one rank.
    with pytest.raises(MemoryGuardStop, match="memory guard stopped the run after step 1: .*rank 0's host has"):
        run(config(char_model_dir, out, *plain, "memory_guard.min_available=0.9999"), Ranks())
    (run_dir,) = list(out.iterdir())
    assert [r["step"] for r in step_rows(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "step-1").is_dir()
    run(config(char_model_dir, out, *plain, f"run.dir={run_dir}", "trainer.resume=auto"), Ranks())
    whole = run(config(char_model_dir, tmp_path / "whole", *plain), Ranks())
    rows, rows_whole = step_rows(run_dir), step_rows(whole["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for a, b in zip(rows_whole, rows):
        assert {k: a[k] for k in LEARNED} == {k: b[k] for k in LEARNED}
    w, w_whole = weights(run_dir, 3), weights(whole["run_dir"], 3)
    assert all(torch.equal(w[k], w_whole[k]) for k in w_whole)


@pytest.mark.slow
def test_a_rank_over_its_plan_sheds_bubble_drafts_and_the_run_stays_the_same(char_model_dir, tmp_path, monkeypatch):
    import json

    from tests.test_spot_loop import two_rank_run
    from tests.test_trainer import step_rows

    monkeypatch.setenv("TAILSPEC_TEST_DELAY", "0.5")  # rank 0 has a window to pre-generate in (tests.mp.slow_rank_train)
    (tmp_path / "shed").mkdir()
    (tmp_path / "plain").mkdir()
    # No margin over the plan: a rank of this small run peaks above its plan (the runtime's imports) at step 1.
    shed = two_rank_run(char_model_dir, tmp_path / "shed", "spot.enabled=false", "bubble.enabled=true",
                        "engine.spec.drafter=pregenerated+eagle", "memory_guard.over_plan=0", "memory_guard.over_plan_gb=0",
                        module="tests.mp.slow_rank_train")
    plain = two_rank_run(char_model_dir, tmp_path / "plain", "spot.enabled=false")
    rows = step_rows(shed)
    assert rows[0].get("mem/guard_shed") == 1.0 and "bubble/pregen_s" in rows[0]
    assert all("bubble/pregen_s" not in r and "mem/guard_shed" not in r for r in rows[1:])
    log = (shed / "rank0.log").read_text()
    assert "bubble drafts off from step 2 (they change no token)" in log
    for a, b in zip(rows, step_rows(plain)):
        assert a["reward/mean"] == b["reward/mean"] and a["train/pg_loss"] == b["train/pg_loss"]
    rollouts = lambda d: sorted(json.dumps(x, sort_keys=True) for x in map(json.loads, (d / "rollouts.jsonl").read_text().splitlines()))  # noqa: E731
    assert rollouts(shed) == rollouts(plain)
