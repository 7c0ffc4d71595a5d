"""The idle window's schedule, in one process on a fake clock: pre-generation takes at most its share
of the expected window, then spot training gets the rest, and neither waits for the window's end
or talks to the other ranks before it is over."""

from __future__ import annotations

import pytest

from common.idle import IdleSchedule, IdleWindow, IdleWork, Phase, ScheduledIdle
from engine.types import FinishReason, Request, Rollout, RolloutBatch
from pipeline.drafts.bubble import BubbleConfig, BubbleStore, BubbleWork


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class ClockEngine:
    """Generates one token per row per decode step of `step_s` fake seconds, checking should_stop
    after each, as the native engine does."""

    sink = None

    def __init__(self, clock: FakeClock, step_s: float, length: int) -> None:
        self.clock, self.step_s, self.length = clock, step_s, length

    def generate(self, requests: list[Request], params, progress=None, should_stop=None) -> RolloutBatch:
        steps = 0
        while steps < self.length:
            self.clock.now += self.step_s
            steps += 1
            if should_stop is not None and should_stop():
                break
        reason = FinishReason.STOP if steps == self.length else FinishReason.PREEMPTED
        rollouts = [Rollout(prompt_id=r.prompt_id, sample=k, prompt_tokens=len(r.prompt), tokens=[1] * steps,
                            logprobs=[0.0] * steps, finish_reason=reason) for r in requests for k in range(r.n)]
        return RolloutBatch(rollouts=rollouts, steps=[], prefill_s=0.0, wall_s=steps * self.step_s, policy_version=0)


class ClockTraining(IdleWork):
    """Spot training's shape: micro-steps of `step_s` until the window ends, then it waits for the end."""

    name = "spot"

    def __init__(self, clock: FakeClock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s
        self.micro_steps: list[int] = []
        self.train_s: list[float] = []

    def work(self, window: IdleWindow) -> dict[str, float]:
        n, t0 = 0, self.clock()
        while not window.others_done():
            self.clock.now += self.step_s
            n += 1
        self.micro_steps.append(n)
        self.train_s.append(self.clock() - t0)
        window.all_done_at()
        return {"spot/micro_steps": float(n)}


def bubble(clock: FakeClock, step_s: float = 0.01, length: int = 10_000) -> BubbleWork:
    requests = [Request(prompt_id=f"p{i}", prompt=[1, 2, 3], n=2) for i in range(4)]
    return BubbleWork(ClockEngine(clock, step_s, length), lambda: requests, lambda step: None, BubbleStore(10**9),
                      BubbleConfig(enabled=True, share=0.5))


def window(clock: FakeClock, length: float, expected: float | None) -> IdleWindow:
    return IdleWindow.make_dummy(clock=clock, ends_at=clock() + length, wait=clock.advance_to, expected=expected)


def test_pregeneration_gets_its_share_of_the_expected_window_and_training_the_rest():
    clock = FakeClock()
    pregen, train = bubble(clock), ClockTraining(clock, step_s=0.02)
    idle = ScheduledIdle(IdleSchedule(pregenerate=True, train=True, share=0.5), pregen, train)
    w = window(clock, length=1.0, expected=1.0)
    idle.work(w)
    metrics = idle.settle()
    assert 0.45 < metrics["bubble/pregen_s"] <= 0.5 + 1e-9  # its share, not a decode step more
    assert metrics["bubble/budget_s"] == 0.5 and metrics["bubble/idle_s"] == pytest.approx(1.0)
    assert train.micro_steps[0] >= 24  # the rest of the window: ~0.5 s of 0.02 s micro-steps
    assert clock() == pytest.approx(w.started + 1.0, abs=0.02)  # nobody ran past the window's end


def test_pregeneration_that_finishes_early_leaves_the_window_to_training():
    clock = FakeClock()
    pregen, train = bubble(clock, step_s=0.01, length=20), ClockTraining(clock, step_s=0.02)
    idle = ScheduledIdle(IdleSchedule(pregenerate=True, train=True, share=0.5), pregen, train)
    idle.work(window(clock, length=1.0, expected=1.0))
    assert idle.settle()["bubble/pregen_s"] == pytest.approx(0.2)
    assert train.micro_steps[0] >= 39  # ~0.8 s


def test_before_any_window_was_seen_pregeneration_takes_the_whole_window():
    clock = FakeClock()
    pregen, train = bubble(clock), ClockTraining(clock, step_s=0.02)
    idle = ScheduledIdle(IdleSchedule(pregenerate=True, train=True, share=0.5), pregen, train)
    idle.work(window(clock, length=0.3, expected=None))
    assert idle.settle()["bubble/pregen_s"] == pytest.approx(0.3, abs=0.011)
    assert train.micro_steps == [0]  # still called: its window end is a collective every rank joins


def test_the_schedule_is_a_function_of_the_windows_clock():
    s = IdleSchedule(pregenerate=True, train=True, share=0.25)
    assert s.pregen_budget(2.0) == 0.5 and s.pregen_budget(None) is None
    assert s.phase(0.4, 2.0) is Phase.PREGENERATE
    assert s.phase(0.4, 2.0, unit_s=0.2) is Phase.TRAIN  # the next unit would end past the budget
    assert s.phase(0.6, 2.0) is Phase.TRAIN
    assert s.phase(0.1, 2.0, pregen_finished=True) is Phase.TRAIN
    assert s.phase(0.1, 2.0, window_over=True) is Phase.WAIT
    alone = IdleSchedule(pregenerate=True, train=False, share=0.25)
    assert alone.pregen_budget(2.0) is None and alone.phase(5.0, 2.0) is Phase.PREGENERATE
    assert IdleSchedule(pregenerate=False, train=True).phase(0.0, 1.0) is Phase.TRAIN
    assert IdleSchedule(pregenerate=False, train=False).phase(0.0, 1.0) is Phase.WAIT
    with pytest.raises(ValueError, match="bubble.share"):
        IdleSchedule(pregenerate=True, train=True, share=0.0)


def test_a_schedule_and_its_works_must_agree():
    clock = FakeClock()
    with pytest.raises(ValueError, match="differ"):
        ScheduledIdle(IdleSchedule(pregenerate=True, train=True), bubble(clock), None)


def test_the_dummy_window_waits_on_its_own_clock():
    clock = FakeClock()
    w = IdleWindow.make_dummy(clock=clock, ends_at=clock() + 2.0, wait=clock.advance_to)
    assert not w.others_done() and w.elapsed() == 0.0
    assert w.all_done_at() == clock() and w.others_done() and w.elapsed() == pytest.approx(2.0)
