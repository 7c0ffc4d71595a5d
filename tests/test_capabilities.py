"""A run's config against what its parts declare (launch.run.capabilities): the rollout backend, the
actor backend and the placement. A setting a part cannot run is refused naming the setting, the
capability and the key, before anything is built; a built backend does no more than its class
declares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.backend import BackendCapabilities
from launch.run import capabilities
from launch.run.capabilities import NEEDS, PARTS, validate_run
from common.config import load_config
from launch.run.config import TrainConfig
from pipeline import config as pipeline_config
from pipeline.actors.base import ActorCapabilities
from pipeline.config import PlacementCapabilities

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CAPABILITIES = {"engine": BackendCapabilities, "actor": ActorCapabilities, "placement": PlacementCapabilities}
SEPARATED = ["pipeline.placement=separated", "pipeline.actor_ranks=1", "trainer.train_shares=shard",
             "rollout.split_groups=false"]

# A config (over configs/tiny.yaml) that turns each setting on, with a choice of its part that runs it.
TURNS_ON = {
    "trainer.old_logprobs=engine": ["trainer.old_logprobs=engine"],
    "bubble.enabled": ["bubble.enabled=true", "engine.spec.drafter=pregenerated+eagle"],
    "rollout.work_stealing": ["rollout.work_stealing=true", "rollout.split_groups=false"],
    "engine.weights=bfloat16": ["engine.weights=bfloat16"],
    "engine.products=bf16": ["engine.products=bf16"],
    "pipeline.placement=separated: spot.enabled": [*SEPARATED, "spot.enabled=true"],
    "algorithm.dynamic_sampling": ["algorithm.name=dapo", "rollout.split_groups=false", "trainer.train_shares=shard"],
    "rollout.long_first": ["rollout.long_first=true"],
    "trainer.train_shares=tokens": ["trainer.train_shares=tokens"],
    "pipeline.placement=separated": SEPARATED,
    "actor.offload_optimizer / actor.offload_params": ["actor.backend=deepspeed", "actor.offload_optimizer=true",
                                                       "actor.precision=float32"],
    "actor.tensor_parallel / actor.pipeline_parallel": ["actor.backend=megatron", "actor.device=cuda",
                                                        "actor.tensor_parallel=2", "actor.precision=float32"],
    "actor.precision=bf16-mixed": ["actor.precision=bf16-mixed"],
    "actor.device=cpu": [],
}


def chosen(part: str, cfg: TrainConfig) -> str:
    return {"engine": cfg.engine.backend, "actor": cfg.actor.backend, "placement": cfg.pipeline.placement}[part]


def choose(part: str, cfg: TrainConfig, name: str) -> None:
    if part == "engine":
        cfg.engine.backend = name
    elif part == "actor":
        cfg.actor.backend = name
    else:
        cfg.pipeline.placement = name


@pytest.fixture
def lacking(monkeypatch):
    """`lacking(part, keeps, capability)`: a choice named "lacking" of `part` that declares every
    capability but `capability`, beside `keeps`, the real choice."""

    def set_lacking(part: str, keeps: str, capability: str):
        key, _, real = PARTS[part]
        caps = CAPABILITIES[part](**{f.name: f.name != capability for f in dataclasses.fields(CAPABILITIES[part])})
        monkeypatch.setitem(PARTS, part, (key, (keeps, "lacking"), lambda name: caps if name == "lacking" else real(name)))
        if part == "engine":  # the drafter and spot checks read the backend's class
            cls = type("Lacking", (), {"CAPS": caps, "serves": classmethod(lambda c, drafter: True)})
            real_class = capabilities.backend_class
            monkeypatch.setattr(capabilities, "backend_class", lambda n: cls if n == "lacking" else real_class(n))
        if part == "placement":  # rows that ask the placement read its caps through pipeline.caps
            monkeypatch.setitem(pipeline_config.PLACEMENTS, "lacking", caps)

    return set_lacking


def test_every_setting_is_named_in_the_table_with_a_real_capability_of_its_part():
    assert {n.setting for n in NEEDS} == set(TURNS_ON)
    for need in NEEDS:
        assert need.capability in {f.name for f in dataclasses.fields(CAPABILITIES[need.part])}, need


@pytest.mark.parametrize("need", NEEDS, ids=lambda n: f"{n.setting}-{n.part}-{n.capability}")
def test_a_setting_is_refused_by_a_choice_lacking_its_capability_naming_both_and_the_fix(need, lacking):
    cfg = load_config(TrainConfig, TINY, TURNS_ON[need.setting])  # the part's choice here runs it
    assert need.asks(cfg)
    key, _, _ = PARTS[need.part]
    keeps = chosen(need.part, cfg)
    lacking(need.part, keeps, need.capability)
    choose(need.part, cfg, "lacking")
    with pytest.raises(ValueError) as e:
        validate_run(cfg)
    message = str(e.value)
    assert need.setting in message and f"capability {need.capability}" in message and f"{key}=lacking" in message
    assert need.fix in message and f"set {key}={keeps}" in message  # the key to change, or a choice that has it
    other = next(f.name for f in dataclasses.fields(CAPABILITIES[need.part])
                 if all(f.name != n.capability for n in NEEDS if n.asks(cfg) and n.part == need.part))
    lacking(need.part, keeps, other)  # a choice lacking only what no setting of the config needs runs it
    validate_run(cfg)


def test_the_vllm_backends_record_is_read_without_building_one(monkeypatch):
    from engine.backends.vllm_engine import VllmEngine

    monkeypatch.setattr(VllmEngine, "__init__", lambda *a, **k: pytest.fail("a vLLM engine was built"))
    cfg = load_config(TrainConfig, TINY, ["engine.backend=vllm", "engine.spec.enabled=false"])
    validate_run(cfg)
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
