"""Step hooks (pipeline.hooks): the Trainer calls each at the step's moments in order, the requests
a hook returns are what the engine takes, per-rank metrics are reduced over ranks as the hook
declares, and a resumed run gives each hook its state by name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from launch.run.build import build_run
from pipeline.dist import Ranks
from pipeline.hooks import StepHook, hook_metrics, load_hook_states
from tests.test_trainer import config, digits_task  # noqa: F401 (a fixture)


class Declares(StepHook):
    reduce = {"x/coverage": "mean", "x/saved": "sum"}

    def __init__(self, metrics: dict[str, float]) -> None:
        self.m = metrics

    def metrics(self, scored) -> dict[str, float]:
        return self.m


class StepWide(StepHook):
    def metrics(self, scored) -> dict[str, float]:
        return {"y/already_the_steps": 5.0}


def test_a_hooks_per_rank_metrics_are_reduced_as_it_declares_and_the_others_pass_through():
    sent = []

    def two_ranks(mine: list[float]) -> list[list[float]]:
        sent.append(mine)
        return [mine, [3.0, math.nan]]  # rank 1 has no x/saved

    out = hook_metrics([Declares({"x/coverage": 1.0, "x/saved": 4.0}), StepWide()], None, two_ranks)
    assert out == {"y/already_the_steps": 5.0, "x/coverage": 2.0, "x/saved": 4.0}
    assert sent == [[1.0, 4.0]]  # one gather, in the declared order
    out = hook_metrics([Declares({})], None, lambda mine: [mine, [math.nan, math.nan]])
    assert out == {}  # a key no rank has is left out


def test_without_a_declared_key_no_rank_gathers():
    assert hook_metrics([StepWide(), StepHook()], None, lambda mine: pytest.fail("gathered")) == {"y/already_the_steps": 5.0}


def test_a_separated_rollout_ranks_idle_work_runs_through_the_update_until_that_versions_push_is_announced():
    import torch.distributed as dist

    from common.idle import IdleWork, PushFlag
    from pipeline.hooks import UpdateIdleWorkHook

    flag = PushFlag(dist.HashStore(), "tailspec/test/0")
    seen = []

    class Work(IdleWork):
        def through_update(self, window):
            flag.announce(window.version - 1)  # an earlier version's push does not end this window
            seen.append((window.step, window.version, window.pushed()))
            flag.announce(window.version)
            seen.append(window.pushed())

    UpdateIdleWorkHook(Work(), flag).updating(3, 4)
    assert seen == [(3, 4, False), True]


def test_a_resumed_run_gives_each_named_hook_its_state():
    class Named(StepHook):
        name = "mine"
        loaded = None

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    named, other = Named(), Named()
    other.name = "absent"
    load_hook_states([named, other, StepHook()], {"mine": {"k": 1}, "": {"never": 1}})
    assert named.loaded == {"k": 1} and other.loaded is None


class Recorder(StepHook):
    """Records the moments it is called at; every request it sees gets a predicted length of 7."""

    def __init__(self) -> None:
        self.moments: list[str] = []

    def begin(self, step):
        self.moments.append(f"begin {step}")

    def requests(self, step, requests):
        self.moments.append(f"requests {step}")
        return [dataclasses.replace(r, predicted_len=7) for r in requests]

    def rolled_out(self, step, scored):
        self.moments.append(f"rolled_out {step}")

    def collect(self, step, scored):
        self.moments.append(f"collect {step}")

    def weights(self, named):
        self.moments.append("weights")
        return named

    def end(self, step):
        self.moments.append(f"end {step}")

    def metrics(self, scored):
        self.moments.append("metrics")
        return {"recorder/rows": float(len(scored.batch))}


def test_the_trainer_calls_a_hook_at_the_steps_moments_and_the_engine_takes_its_requests(char_model_dir, digits_task,
                                                                                         tmp_path):
    built = build_run(config(char_model_dir, tmp_path, "engine.spec.enabled=false", "trainer.steps=2"), Ranks())
    try:
        recorder = Recorder()
        built.trainer.hooks.append(recorder)
        taken = []
        generate = built.engine.generate

        def generate_and_keep(requests, params, **kw):
            taken.extend(requests)
            return generate(requests, params, **kw)

        built.engine.generate = generate_and_keep
        result = built.trainer.step()
        assert recorder.moments == ["begin 0", "requests 0", "rolled_out 0", "collect 0", "weights", "end 0", "metrics"]
        assert taken and all(r.predicted_len == 7 for r in taken)
        assert result.metrics["recorder/rows"] == len(result.rollouts.batch)
    finally:
        built.close()
