"""The run config: one section per component, loaded from configs/*.yaml (launch.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(kw_only=True)
class RunSection:
    name: str = "tiny"
    out_dir: str = "runs"  # each run writes runs/<name>-<timestamp>/
    seed: int = 0


@dataclass(kw_only=True)
class ModelSection:
    path: str = "checkpoints/tiny"  # HF folder with tokenizer


@dataclass(kw_only=True)
class TaskSection:
    name: str = "arith"
    eval_problems: int = 200  # held-out problems for greedy accuracy
    prompts: int = 32  # prompts per rollout batch
    seed: int = 1234

    def validate(self) -> None:
        if self.eval_problems < 1 or self.prompts < 1:
            raise ValueError("task.eval_problems and task.prompts must be >= 1")


@dataclass(kw_only=True)
class RolloutSection:
    n: int = 4  # samples per prompt (a GRPO group)
    max_new_tokens: int = 384
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")


@dataclass(kw_only=True)
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
