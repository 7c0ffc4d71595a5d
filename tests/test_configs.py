"""Every shipped config file loads into the typed run config, and its values reach the config."""

from __future__ import annotations

import re

import pytest

from common.config import load_config, read_yaml
from launch.run.config import TrainConfig
from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) for every leaf of a YAML mapping."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_configs_folder_holds_configs():
    assert {"tiny", "smollm2"} <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_file_loads_into_the_train_config_with_its_values(path):
    cfg = load_config(TrainConfig, path)
    data = read_yaml(path)  # with its base: merged in
    for key, value in _leaves({k: v for k, v in data.items() if k != "base"}):
        got = _get(cfg, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key


@pytest.mark.parametrize("overrides, message", [
    (["rollout.work_stealing=true", "algorithm.name=dapo", "trainer.train_shares=shard", "rollout.split_groups=false"],
     "rollout.work_stealing cannot be combined with algorithm.dynamic_sampling"),
    (["algorithm.name=dapo"], "trainer.train_shares=tokens cannot be combined with algorithm.dynamic_sampling"),
    (["rollout.long_first=true", "trainer.async_steps=1", "bubble.enabled=false", "trainer.train_shares=shard",
      "rollout.split_groups=false"],
     "rollout.long_first needs trainer.async_steps=0"),
    (["trainer.train_shares=tokens", "pipeline.placement=separated", "pipeline.actor_ranks=1", "rollout.split_groups=false"],
     "set trainer.train_shares=shard"),
    (["rollout.split_groups=true", "trainer.train_shares=shard", "algorithm.name=dapo"],
     "rollout.split_groups cannot be combined with algorithm.dynamic_sampling"),
    (["rollout.work_stealing=true"], "rollout.work_stealing and rollout.split_groups are two ways"),
    (["rollout.work_stealing=true", "rollout.split_groups=false", "engine.backend=vllm", "engine.spec.enabled=false"],
     "needs the capability pulls_requests that engine.backend=vllm lacks"),
    (["rollout.steal_inflight=-1"], "rollout.steal_inflight must be >= 0"),
])
def test_a_rollout_schedule_the_loop_cannot_run_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", overrides)
