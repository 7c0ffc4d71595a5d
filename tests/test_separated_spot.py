"""Spot training on a separated run's rollout ranks: the update window ends exactly at its own push's
announcement, a rollout rank trains through the actor's update and serves the step's average, and a
separated run with spot training rolls out the same tokens as without while its pool trains in the
update phase."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed as dist

from common.idle import ControlPlane, IdleWindow, PushFlag, RankState, UpdateWindow
from spot.coordinator import FilledTime
from tests.test_separated import rollouts, separated, step_rows, torchrun


class TickClock:
    """A clock that moves `tick` seconds on every read: a window's end comes after a known number of
    checks, with no sleep and no race."""

    def __init__(self, tick: float = 1.0) -> None:
        self.now, self.tick = 100.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


def test_an_update_window_ends_at_its_own_versions_announcement_and_reports_its_time():
    store, clock = dist.HashStore(), TickClock()
    actor0, rollout = PushFlag(store, "tailspec/run/0", clock), PushFlag(store, "tailspec/run/0", clock)
    window = rollout.window(step=3, version=4)
    assert (window.step, window.version) == (3, 4) and not window.pushed()
    actor0.announce(3)  # an earlier push (or another version's) does not end it
    assert not window.pushed()
    PushFlag(store, "tailspec/other-run/0", clock).announce(4)  # nor another run's of the same job
    assert not window.pushed()
    actor0.announce(4)
    at = clock.now
    assert window.pushed() and window.pushed_at() == at and window.pushed_at() > window.started


def test_filled_time_counts_training_inside_the_idle_span_and_the_rest_as_overrun():
    assert FilledTime.of(t0=1.0, t1=4.0, started=0.0, end=5.0) == FilledTime(useful_s=3.0, idle_s=5.0, overrun_s=0.0)
    assert FilledTime.of(t0=1.0, t1=6.5, started=0.0, end=5.0) == FilledTime(useful_s=4.0, idle_s=5.0, overrun_s=1.5)
    # the window had ended before training began (a rank that was last): no idle time, all overrun
    assert FilledTime.of(t0=2.0, t1=3.0, started=2.0, end=1.0) == FilledTime(useful_s=0.0, idle_s=0.0, overrun_s=1.0)


@pytest.fixture
def buffer_name():
    name = f"tailspec-test-{uuid.uuid4().hex[:8]}"
    yield name
    for p in (f"/dev/shm/{name}", f"/dev/shm/{name}.lock"):
        if os.path.exists(p):
            os.unlink(p)


class OneRank:
    """One rollout rank's spot work in one process: a random llama and drafter, the real buffer and
    trainer, a store in memory, a clock that ticks on every read. `rolled_out()` generates two
    rollouts of step 1 and stashes them: cut at max_new_tokens, they are the long responses that
    step 2's windows sample."""

    def __init__(self, model_dir, buffer_name: str, max_micro_steps: int = 50) -> None:
        from engine.checkpoint import load_checkpoint
        from engine.config import EngineConfig
        from engine.engine import RolloutEngine
        from engine.spec.config import SpecConfig
        from engine.spec.eagle import EagleConfig, EagleModel
        from engine.spec.eagle_drafter import EagleDrafter
        from spot.buffer.ring import DataBuffer
        from spot.colocated import drafter_copy
        from spot.coordinator import SpotSettings
        from spot.training.step import DrafterOptim
        from spot.separated import SeparatedSpotWork
        from spot.buffer.sink import DataBufferSink
        from spot.training.trainer import SpotTrainer

        target = load_checkpoint(model_dir)
        torch.manual_seed(0)
        net = EagleModel(EagleConfig.for_target(target.config), target)
        self.engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, spec=SpecConfig(depth=2, verify_tokens=2)),
                                    EagleDrafter(net))
        self.start = net.fc.weight.detach().clone()
        self.clock, self.control = TickClock(), ControlPlane(dist.HashStore(), 0, 1)
        self.buffer = buffer = DataBuffer.create(buffer_name, capacity_bytes=2**21, feature_size=net.config.feature_size)
        self.engine.sink = sink = DataBufferSink(buffer, max_new_tokens=8)
        self.trainer = SpotTrainer(drafter_copy(net), DrafterOptim(lr=3e-3, warmup_steps=0), window=64, rows_per_step=4)
        self.work = SeparatedSpotWork(self.engine, self.trainer, buffer, sink, self.control,
                                      SpotSettings(rows_per_step=4, offset_ratio=0.0, max_micro_steps=max_micro_steps))

    def rolled_out(self) -> None:
        from engine.sampling import SamplingParams
        from engine.types import Request

        self.work.begin(1)
        batch = self.engine.generate([Request(prompt_id="p", prompt=[5, 9, 17], n=2)],
                                     SamplingParams(max_new_tokens=8, temperature=1.0, seed=0))
        self.work.rollouts_done(1, batch)

    def tail(self, ticks: float, last: bool) -> IdleWindow:
        return IdleWindow.make_dummy(clock=self.clock, ends_at=self.clock.now + ticks, wait=self.clock.advance_to, step=2,
                                     opened_last=last)

    def update(self, ticks: float) -> UpdateWindow:
        return UpdateWindow.make_dummy(clock=self.clock, pushed_at=self.clock.now + ticks, wait=self.clock.advance_to,
                                       step=2, version=2)


def test_the_last_rollout_rank_trains_through_the_update_until_the_push_and_serves_the_average(hf_folders, buffer_name):
    one = OneRank(hf_folders["llama"], buffer_name)
    with one.buffer as buffer:
        one.rolled_out()
        # The last rollout rank to finish: its tail window is over as it opens, and it holds its features.
        one.work.work(one.tail(0, last=True))
        assert buffer.stats()["buffer/entries"] == 0 and one.trainer.micro_steps == 0
        # The update window: the features go in as it opens, then micro-steps until the push is announced.
        end = one.clock.now + 60
        update = one.update(60)
        one.work.through_update(update)
        assert buffer.stats()["buffer/entries"] == 2
        assert one.control.states() == [(2, RankState.BARRIER)]
        n = one.trainer.micro_steps
        assert 0 < n < 50  # stopped by the announcement, not by the budget
        assert one.engine.drafter.version == 0  # nothing served before the push: the average is pending
        m = one.work.settle()
    assert m["spot/micro_steps"] == m["spot/update_micro_steps"] == n
    assert m["spot/update_idle_s"] == m["spot/idle_s"] == pytest.approx(end - update.started)
    # each window stops at its first check past its end: the clock reads after it (a tick each) are all the overrun
    assert m["spot/overrun_s"] <= 3
    assert 0.8 < m["spot/utilisation"] <= 1 and m["spot/drafter_version"] == 1 and "spot/drafter_loss" in m
    # The engine serves the average (a single rank: its own replica) as drafter version 1.
    served = dict(one.engine.drafter_nets()[0].named_parameters())
    assert one.engine.drafter.version == 1
    assert all(torch.equal(served[k], p) for k, p in one.trainer.model.named_parameters())
    assert not torch.equal(served["fc.weight"], one.start)


def test_an_early_rollout_rank_trains_in_both_windows_and_averages_once_per_step_within_its_budget(hf_folders,
                                                                                                   buffer_name):
    one = OneRank(hf_folders["llama"], buffer_name, max_micro_steps=4)
    with one.buffer as buffer:
        one.rolled_out()
        one.work.work(one.tail(10_000, last=False))  # a long tail: the step's budget of 4 micro-steps runs out in it
        in_tail = one.trainer.micro_steps
        assert in_tail == 4 and buffer.stats()["buffer/entries"] == 2  # an early rank puts its features at once
        assert one.work.pending is None and one.engine.drafter.version == 0  # no average yet: the step is not over
        one.work.through_update(one.update(50))
        assert one.trainer.micro_steps == in_tail  # the budget is the step's, across both windows
        m = one.work.settle()
    assert m["spot/micro_steps"] == 4 and m["spot/update_micro_steps"] == 0
    assert m["spot/idle_s"] > m["spot/update_idle_s"] > 0  # both windows' idle time, counted once each
    assert m["spot/utilisation"] < 0.5  # the budget left most of the idle time unused, and it says so
    assert one.engine.drafter.version == 1


def spot(drafter: str) -> list[str]:
    return ["spot.enabled=true", "spot.rows_per_step=4", "spot.window=64", "engine.spec.drafter=eagle",
            f"engine.spec.drafter_path={drafter}", "engine.spec.depth=4", "engine.spec.verify_tokens=4"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_separated_run_with_spot_training_rolls_out_the_same_tokens_and_trains_through_the_update(
        char_model_dir, char_drafter_dir, tmp_path, mode):
    extra = [f"model.path={char_model_dir}", "trainer.steps=3", *separated(1), *spot(char_drafter_dir),
             *(["trainer.async_steps=1"] if mode == "async" else [])]
    torchrun(3, tmp_path / "off", *extra, "spot.enabled=false")
    torchrun(3, tmp_path / "on", *extra)
    assert rollouts(tmp_path / "off") == rollouts(tmp_path / "on")  # spot training changes the drafter, never a token
    rows = step_rows(tmp_path / "on")
    assert [r["step"] for r in rows] == [1, 2, 3]
    versions = [r["spot/drafter_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] >= 1
    if mode == "sync":  # the actor's update is idle rollout time: the pool trains in it every step
        assert versions == [1, 2, 3]  # one average per step, served before the next rollouts
        for r in rows:
            assert r["spot/idle_s"] >= r["spot/update_idle_s"] > 0 and r["spot/update_micro_steps"] > 0
            # the rollout ranks' idle time through the update counts the time they trained in it
            assert r["timing/update_idle/rank1"] + r["timing/update_idle/rank2"] >= 0.9 * r["spot/update_idle_s"]
        assert sum(r["spot/train_s"] for r in rows) / sum(r["spot/idle_s"] for r in rows) >= 0.8
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("tailspec-on-")]  # the node's segment is gone


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pool_member_killed_while_training_through_the_update_ends_the_job_and_a_resume_is_exact(
        char_model_dir, char_drafter_dir, tmp_path):
    from tests.test_separated import assert_same_run

    extra = [f"model.path={char_model_dir}", "trainer.steps=4", "trainer.save_every=1", *separated(2),
             *spot(char_drafter_dir)]
    pids = tmp_path / "pids"
    pids.mkdir()
    # rank 2: the first rollout rank, which owns the node's DataBuffer segment
    killed = torchrun(4, tmp_path / "run", *extra, module="tests.mp.killed_spot_member_train", check=False,
                      env={"TAILSPEC_TEST_PIDS": str(pids), "TAILSPEC_TEST_KILL_RANK": "2", "TAILSPEC_TEST_KILL_STEP": "3"})
    assert killed.returncode != 0
    assert "rank      : 2" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert len(list(pids.iterdir())) == 4
    for pid in (int(f.read_text()) for f in pids.iterdir()):  # no rank left waiting on a peer
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1", "step-2"]

    assert (tmp_path / "run" / "checkpoints" / "step-2" / "spot").is_dir()  # the drafter's trainer, written with it

    torchrun(4, tmp_path / "run", *extra, "trainer.resume=auto")
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("tailspec-run-")]  # the dead owner's segment too
    torchrun(4, tmp_path / "uninterrupted", *extra)
    assert_same_run(tmp_path / "uninterrupted", tmp_path / "run", steps=4)
    # the resumed pool continued from step 2's drafter: it serves the uninterrupted run's versions
    resumed, whole = step_rows(tmp_path / "run"), step_rows(tmp_path / "uninterrupted")
    assert [r["spot/drafter_version"] for r in resumed] == [r["spot/drafter_version"] for r in whole] == [1, 2, 3, 4]
