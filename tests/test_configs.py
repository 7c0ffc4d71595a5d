"""Every shipped config file loads into the typed run config, and its values reach the config."""

from __future__ import annotations

import pytest

from launch.config import load_config, read_yaml
from launch.run_config import TrainConfig
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
