"""Tests for common/config.py on small hand-written config trees."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from common.config import (
    apply_overrides,
    from_dict,
    load_config,
    override_args,
    parse_override,
    save_config,
    to_dict,
)


@dataclasses.dataclass(kw_only=True)
class SpecConfig:
    enabled: bool = True
    depth: int = 4
    accept_rates: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.25])

    def validate(self) -> None:
        if self.depth < 1:
            raise ValueError(f"engine.spec.depth must be >= 1, got {self.depth}")


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    model: str
    dtype: Literal["bf16", "fp32"] = "bf16"
    max_batch: int = 16
    temperature: float = 1.0
    stop_ids: tuple[int, ...] = (2,)
    seed: int | None = None
    spec: SpecConfig = dataclasses.field(default_factory=SpecConfig)


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    lr: float = 1e-6
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    engine: EngineConfig
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def run_yaml(tmp_path: Path) -> Path:
    return write(
        tmp_path / "run.yaml",
        "engine:\n"
        "  model: tiny\n"
        "  dtype: fp32\n"
        "  stop_ids: [2, 7]\n"
        "  spec:\n"
        "    depth: 3\n"
        "train:\n"
        "  lr: 3e-4\n"
        "  tags: [a, b]\n",
    )


def test_yaml_values_reach_nested_sections_and_defaults_fill_the_rest(run_yaml: Path) -> None:
    cfg = load_config(RunConfig, run_yaml)
    assert cfg.engine.model == "tiny"
    assert cfg.engine.dtype == "fp32"
    assert cfg.engine.stop_ids == (2, 7)
    assert cfg.engine.spec == SpecConfig(depth=3)
    assert cfg.engine.seed is None
    assert cfg.train.lr == 3e-4
    assert cfg.train.tags == ["a", "b"]


def test_save_then_load_reproduces_the_config(run_yaml: Path, tmp_path: Path) -> None:
    cfg = load_config(RunConfig, run_yaml, ["engine.seed=5", "engine.spec.enabled=false"])
    out = tmp_path / "runs" / "r1" / "config.yaml"
    save_config(cfg, out)
    assert load_config(RunConfig, out) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]


def test_to_dict_writes_tuples_as_lists() -> None:
    cfg = RunConfig(engine=EngineConfig(model="m"))
    assert to_dict(cfg)["engine"]["stop_ids"] == [2]


def test_overrides_set_bools_ints_floats_lists_and_nested_keys(run_yaml: Path) -> None:
    cfg = load_config(
        RunConfig,
        run_yaml,
        [
            "engine.spec.enabled=false",
            "engine.max_batch=64",
            "engine.temperature=1",
            "engine.spec.accept_rates=[0.9, 0.8, 0.7]",
            "train.lr=1e-5",
            "engine.seed=null",
        ],
    )
    assert cfg.engine.spec.enabled is False
    assert cfg.engine.max_batch == 64
    assert cfg.engine.temperature == 1.0 and isinstance(cfg.engine.temperature, float)
    assert cfg.engine.spec.accept_rates == [0.9, 0.8, 0.7]
    assert cfg.train.lr == 1e-5
    assert cfg.engine.seed is None
    assert cfg.engine.spec.depth == 3


def test_override_creates_sections_absent_from_yaml() -> None:
    cfg = load_config(RunConfig, None, ["engine.model=m", "engine.spec.depth=2"])
    assert cfg.engine.model == "m" and cfg.engine.spec.depth == 2


def test_quoted_override_value_stays_a_string() -> None:
    cfg = load_config(RunConfig, None, ['engine.model="16"'])
    assert cfg.engine.model == "16"


def test_apply_overrides_leaves_its_input_unchanged() -> None:
    data = {"engine": {"spec": {"depth": 1}}}
    out = apply_overrides(data, ["engine.spec.depth=2"])
    assert data == {"engine": {"spec": {"depth": 1}}}
    assert out == {"engine": {"spec": {"depth": 2}}}


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(ValueError, match="'engine.model' is a value, not a section"):
        apply_overrides({"engine": {"model": "m"}}, ["engine.model.x=1"])


def test_unknown_key_error_names_dotted_key(run_yaml: Path) -> None:
    with pytest.raises(ValueError, match=r"'engine\.spec\.enabeld'.*did you mean.*enabled"):
        from_dict(RunConfig, {"engine": {"model": "m", "spec": {"enabeld": False}}})


def test_unknown_key_error_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match="valid keys under 'train': lr, tags"):
        from_dict(RunConfig, {"engine": {"model": "m"}, "train": {"batch": 1}})


def test_unknown_key_in_yaml_is_reported_with_its_path(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "engine:\n  model: m\n  speculate: true\n")
    with pytest.raises(ValueError, match=r"'engine\.speculate'"):
        load_config(RunConfig, path)


def test_unknown_override_key_is_reported_with_its_path(run_yaml: Path) -> None:
    with pytest.raises(ValueError, match=r"'engine\.spec\.width'"):
        load_config(RunConfig, run_yaml, ["engine.spec.width=3"])


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"max_batch": "16"}, r"'engine\.max_batch' expects int, got '16'"),
        ({"max_batch": True}, r"'engine\.max_batch' expects int, got True"),
        ({"max_batch": 1.5}, r"'engine\.max_batch' expects int, got 1\.5"),
        ({"temperature": "hot"}, r"'engine\.temperature' expects float"),
        ({"model": 3}, r"'engine\.model' expects str, got 3"),
        ({"stop_ids": [2, "x"]}, r"'engine\.stop_ids\[1\]' expects int, got 'x'"),
        ({"stop_ids": 2}, r"'engine\.stop_ids' expects tuple"),
        ({"seed": "s"}, r"'engine\.seed' expects int, got 's'"),
        ({"spec": {"enabled": 1}}, r"'engine\.spec\.enabled' expects bool, got 1"),
        ({"spec": {"accept_rates": 0.5}}, r"'engine\.spec\.accept_rates' expects list"),
        ({"spec": None}, r"section 'engine\.spec' must be a mapping"),
    ],
)
def test_wrong_type_error_names_key_type_and_value(section: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        from_dict(RunConfig, {"engine": {"model": "m", **section}})


def test_bad_literal_error_lists_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"'engine\.dtype' must be one of 'bf16', 'fp32', got 'fp16'"):
        load_config(RunConfig, None, ["engine.model=m", "engine.dtype=fp16"])


def test_missing_required_key_is_named() -> None:
    with pytest.raises(ValueError, match=r"missing required config key 'engine\.model'"):
        from_dict(RunConfig, {"engine": {}})
    with pytest.raises(ValueError, match=r"missing required config key 'engine'"):
        from_dict(RunConfig, {})


def test_validate_hook_runs_on_nested_sections() -> None:
    with pytest.raises(ValueError, match=r"engine\.spec\.depth must be >= 1, got 0"):
        load_config(RunConfig, None, ["engine.model=m", "engine.spec.depth=0"])


def test_base_file_is_merged_underneath(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    write(
        tmp_path / "base" / "common.yaml",
        "engine:\n  model: big\n  max_batch: 8\n  spec:\n    depth: 5\n    enabled: false\n"
        "train:\n  tags: [base]\n",
    )
    child = write(
        tmp_path / "child.yaml",
        "base: base/common.yaml\nengine:\n  max_batch: 32\n  spec:\n    depth: 2\n",
    )
    cfg = load_config(RunConfig, child)
    assert cfg.engine.model == "big"
    assert cfg.engine.max_batch == 32
    assert cfg.engine.spec == SpecConfig(depth=2, enabled=False)
    assert cfg.train.tags == ["base"]


def test_base_cycle_is_rejected(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        load_config(RunConfig, tmp_path / "a.yaml")


def test_missing_file_error_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(RunConfig, tmp_path / "nope.yaml")


def test_missing_base_file_error_names_path(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "base: gone.yaml\n")
    with pytest.raises(FileNotFoundError, match="gone.yaml"):
        load_config(RunConfig, path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n"])
def test_non_mapping_file_is_rejected_naming_it(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "list.yaml", text)
    with pytest.raises(ValueError, match=r"list\.yaml must contain a mapping"):
        load_config(RunConfig, path)


def test_invalid_yaml_is_rejected_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.yaml", "engine: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken\.yaml is not valid YAML"):
        load_config(RunConfig, path)


def test_parse_override_types_values_with_yaml() -> None:
    assert parse_override("a.b.c=false") == (["a", "b", "c"], False)
    assert parse_override("a=16") == (["a"], 16)
    assert parse_override("a=0.9") == (["a"], 0.9)
    assert parse_override("a=1e-4") == (["a"], 1e-4)
    assert parse_override("a=[1,2]") == (["a"], [1, 2])
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=foo") == (["a"], "foo")
    assert parse_override("a=x=y") == (["a"], "x=y")


@pytest.mark.parametrize("text", ["engine.spec.enabled", "=1", "a..b=1", ".a=1", "a b=1"])
def test_malformed_override_error_shows_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"section\.key=value"):
        parse_override(text)


def test_override_args_splits_overrides_from_other_args() -> None:
    argv = ["--config", "c.yaml", "engine.spec.enabled=false", "--out=runs/x", "train.lr=1e-5", "x"]
    overrides, rest = override_args(argv)
    assert overrides == ["engine.spec.enabled=false", "train.lr=1e-5"]
    assert rest == ["--config", "c.yaml", "--out=runs/x", "x"]


@pytest.mark.parametrize("overrides,keys", [
    (["trainer.old_logprobs=engine"], ("trainer.old_logprobs", "engine.backend")),
    (["bubble.enabled=true", "engine.spec.drafter=pregenerated+eagle"], ("engine.backend=vllm", "pre-generated")),
    (["spot.enabled=true", "engine.spec.drafter=ngram"], ("spot.enabled", "engine.spec.drafter")),
])
def test_what_the_vllm_backend_cannot_do_is_refused_naming_the_keys(overrides, keys):
    from launch.run.config import TrainConfig

    base = ["engine.backend=vllm", "engine.spec.enabled=true", "engine.spec.drafter_path=checkpoints/tiny-drafter"]
    with pytest.raises(ValueError) as e:
        load_config(TrainConfig, Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml", base + overrides)
    assert all(k in str(e.value) for k in keys), str(e.value)


def test_building_a_vllm_engine_without_vllm_says_how_to_get_it():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the missing-vllm error cannot show")
    from engine.backends.factory import build_rollout_engine
    from engine.config import EngineConfig

    with pytest.raises((ImportError, ValueError), match="setup-vllm"):
        build_rollout_engine("checkpoints/tiny", EngineConfig(backend="vllm"), seed=0)


def test_spot_training_without_speculation_is_refused_naming_both_keys() -> None:
    from launch.run.config import TrainConfig

    with pytest.raises(ValueError, match=r"spot.enabled.*engine.spec.enabled is false"):
        load_config(TrainConfig, Path(__file__).parents[1] / "configs" / "tiny.yaml", ["spot.enabled=true", "engine.spec.enabled=false"])
