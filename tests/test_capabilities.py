"""A run's config against its rollout backend's declared capabilities (launch.capabilities): a
setting the backend cannot run is refused naming the capability and the key, before anything is
built; a built backend does no more than its class declares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.backend import BackendCapabilities
from launch import capabilities
from launch.capabilities import NEEDS, check_capabilities
from launch.config import load_config
from launch.run_config import TrainConfig

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
EVERY = BackendCapabilities(**{f.name: True for f in dataclasses.fields(BackendCapabilities)})

# A config (over configs/tiny.yaml) that turns each setting on; the native engine runs every one.
TURNS_ON = {
    "trainer.old_logprobs=engine": ["trainer.old_logprobs=engine"],
    "bubble.enabled": ["bubble.enabled=true", "engine.spec.drafter=pregenerated+eagle"],
    "rollout.work_stealing": ["rollout.work_stealing=true", "rollout.split_groups=false"],
    "engine.weights=bfloat16": ["engine.weights=bfloat16"],
    "engine.products=bf16": ["engine.products=bf16"],
    "pipeline.placement=separated: spot.enabled": ["pipeline.placement=separated", "pipeline.actor_ranks=1",
                                                   "trainer.train_shares=shard", "rollout.split_groups=false",
                                                   "spot.enabled=true"],
}


def fake_backend(caps: BackendCapabilities):
    return type("Fake", (), {"CAPS": caps, "serves": classmethod(lambda cls, drafter: True)})


@pytest.fixture
def lacking(monkeypatch):
    """engine.backend=lacking names a backend whose class declares every capability but the one
    `lacking(capability)` sets; engine.backend=native keeps the real one."""
    real = capabilities.backend_class
    chosen = {}
    monkeypatch.setattr(capabilities, "BACKENDS", ("native", "lacking"))
    monkeypatch.setattr(capabilities, "backend_class", lambda name: chosen["cls"] if name == "lacking" else real(name))

    def set_lacking(capability: str):
        chosen["cls"] = fake_backend(dataclasses.replace(EVERY, **{capability: False}))

    return set_lacking


def test_every_setting_is_named_in_the_table_with_a_real_capability():
    fields = {f.name for f in dataclasses.fields(BackendCapabilities)}
    assert {n.setting for n in NEEDS} == set(TURNS_ON)
    assert all(n.capability in fields for n in NEEDS)


@pytest.mark.parametrize("need", NEEDS, ids=lambda n: f"{n.setting}-{n.capability}")
def test_a_setting_is_refused_by_a_backend_lacking_its_capability_naming_both_and_the_fix(need, lacking):
    cfg = load_config(TrainConfig, TINY, TURNS_ON[need.setting])  # the native engine runs it
    assert need.asks(cfg)
    lacking(need.capability)
    cfg.engine.backend = "lacking"
    with pytest.raises(ValueError) as e:
        check_capabilities(cfg)
    message = str(e.value)
    assert need.setting in message and f"capability {need.capability}" in message and "engine.backend=lacking" in message
    assert need.fix in message and "set engine.backend=native" in message  # the key to change, or a backend that has it
    lacking("sleeps")  # a backend lacking only what the setting does not need runs it
    check_capabilities(cfg)


def test_the_vllm_backends_record_is_read_without_building_one(monkeypatch):
    from engine.backends.vllm_engine import VllmEngine

    monkeypatch.setattr(VllmEngine, "__init__", lambda *a, **k: pytest.fail("a vLLM engine was built"))
    cfg = load_config(TrainConfig, TINY, ["engine.backend=vllm", "engine.spec.enabled=false"])
    check_capabilities(cfg)
    with pytest.raises(ValueError, match="trainer.old_logprobs=engine .* the capability exact_logprobs that "
                                         "engine.backend=vllm lacks"):
        load_config(TrainConfig, TINY, ["engine.backend=vllm", "trainer.old_logprobs=engine"])


def test_a_drafter_the_backend_does_not_serve_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="engine.backend=vllm does not serve engine.spec.drafter=history"):
        load_config(TrainConfig, TINY, ["engine.backend=vllm", "engine.spec.drafter=history+eagle"])


def test_a_built_native_engine_does_no_more_than_its_class_declares(char_model_dir):
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.kernels.library import available

    configs = [EngineConfig(max_batch=2, max_len=32)]
    if available()[0]:  # bf16 weight copies run in the CPU kernels
        configs.append(EngineConfig(max_batch=2, max_len=32, weights="bfloat16"))
    for cfg in configs:
        caps = RolloutEngine.from_pretrained(char_model_dir, cfg).caps
        declared = RolloutEngine.CAPS
        assert all(getattr(declared, f.name) or not getattr(caps, f.name) for f in dataclasses.fields(caps))
        assert caps.exact_logprobs == (cfg.weights == "float32")
