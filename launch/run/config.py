"""The run config: one section per component, loaded from configs/*.yaml (common.config).

TrainConfig assembles the sections, each defined beside the part that reads it (the loop's in
pipeline.config), with the run's own (`run:`, `model:`); its `validate()` checks what spans
several sections (launch.run.capabilities)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from launch.slurm.config import ClusterSection
from launch.run.capabilities import validate_run
from pipeline.actors.base import ActorConfig
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.drafts.bubble import BubbleConfig
from pipeline.config import PipelineSection, RolloutSection, TaskSection, TrainerSection
from pipeline.memory_guard import MemoryGuardConfig
from pipeline.metrics.config import MetricsConfig
from spot.config import SpotConfig


@dataclass(kw_only=True)
class RunSection:
    name: str = "tiny"
    out_dir: str = "runs"  # each run writes runs/<name>-<timestamp>/
    # A fixed run folder instead (a Slurm job's is runs/<name>-<job id>, so a requeued job finds its
    # checkpoints); None: out_dir/<name>-<timestamp>.
    dir: str | None = None
    seed: int = 0  # keys the sampling noise, the data order and the actor's initialisation


@dataclass(kw_only=True)
class ModelSection:
    path: str = "checkpoints/tiny"  # HF folder with tokenizer: the engine and the actor load it


@dataclass(kw_only=True)
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    spot: SpotConfig = field(default_factory=SpotConfig)
    bubble: BubbleConfig = field(default_factory=BubbleConfig)
    cluster: ClusterSection = field(default_factory=ClusterSection)  # Slurm jobs only (launch.slurm)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    memory_guard: MemoryGuardConfig = field(default_factory=MemoryGuardConfig)

    def validate(self) -> None:
        """What spans several sections: each part's capabilities and the settings that cannot go
        together (launch.run.capabilities), and the run folder a resume needs."""
        validate_run(self)
        if self.trainer.resume == "auto" and not self.run.dir:
            raise ValueError("trainer.resume=auto resumes the latest checkpoint of a fixed run folder: set run.dir too")
