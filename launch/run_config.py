"""The run config: one section per component, loaded from configs/*.yaml (launch.config).

TrainConfig assembles the sections, each defined beside the part that reads it (the loop's in
pipeline.config), with the run's own (`run:`, `model:`); its `validate()` checks what spans
several sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from launch.capabilities import check_capabilities
from launch.cluster_config import ClusterSection
from pipeline.actors.base import ActorConfig, having
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.bubble import BubbleConfig
from pipeline.config import PipelineSection, RolloutSection, TaskSection, TrainerSection
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

    def validate(self) -> None:
        check_capabilities(self)  # what the rollout backend can run (launch.capabilities)
        if self.pipeline.placement == "separated":
            self._validate_separated()
        self._validate_weights()
        self._validate_schedule()
        if self.trainer.resume == "auto" and not self.run.dir:
            raise ValueError("trainer.resume=auto resumes the latest checkpoint of a fixed run folder: set run.dir too")
        if self.spot.enabled and not self.engine.spec.enabled:
            raise ValueError("spot.enabled trains the engine's EAGLE drafter, but engine.spec.enabled is false: set "
                             "spot.enabled=false, or turn speculation on with an EAGLE drafter (engine.spec.drafter: eagle)")
        if self.bubble.enabled:
            if not (self.engine.spec.enabled and self.engine.spec.drafter_spec.pregenerated):
                raise ValueError("bubble.enabled needs engine.spec.enabled: true and a drafter that proposes pre-generated "
                                 f"responses first (engine.spec.drafter: pregenerated+eagle), got {self.engine.spec.drafter!r}")
            if self.trainer.async_steps:
                raise ValueError("bubble.enabled pre-generates step t+1 with policy t in step t's idle window; with "
                                 "trainer.async_steps=1 step t+1 is rolled out before that window: use one or the other")

    def _validate_separated(self) -> None:
        """What a separated placement does not run (yet): each named by its key."""
        unsupported = [
            (self.bubble.enabled, "bubble.enabled: pre-generation fills a colocated rank's idle window; set "
                                  "bubble.enabled=false"),
            (bool(self.algorithm.dynamic_sampling), "algorithm.dynamic_sampling (DAPO's refill rounds) is not supported "
                                                   "by the separated placement; set algorithm.dynamic_sampling=false"),
            (not self.actor.caps.subgroup, f"actor.backend={self.actor.backend} builds its parallel groups over every "
                                           "rank of the job (it lacks the capability subgroup); train the actor ranks "
                                           f"with {having('subgroup')}"),
            (self.rollout.work_stealing, "rollout.work_stealing balances a colocated step's rollouts across ranks; set "
                                         "rollout.work_stealing=false"),
            (self.rollout.long_first, "rollout.long_first orders a colocated rank's admissions (pipeline.schedule); "
                                      "set rollout.long_first=false"),
            (self.trainer.train_shares == "tokens", "trainer.train_shares=tokens deals a colocated step's groups to its "
                                                    "ranks by tokens; set trainer.train_shares=shard"),
        ]
        for bad, why in unsupported:
            if bad:
                raise ValueError(f"pipeline.placement=separated: {why} (or use pipeline.placement=colocated)")

    def _validate_schedule(self) -> None:
        """What the rollout schedule (pipeline.schedule) supports: one generation round per step, synchronous."""
        chosen = [k for k, on in (("rollout.work_stealing", self.rollout.work_stealing),
                                  # a separated run's rollout ranks split groups on their own (pipeline.separated_rollout)
                                  ("rollout.split_groups", self.rollout.split_groups and self.pipeline.placement == "colocated"),
                                  ("rollout.long_first", self.rollout.long_first),
                                  ("trainer.train_shares=tokens", self.trainer.train_shares == "tokens")) if on]
        if not chosen:
            return
        if self.algorithm.dynamic_sampling:
            raise ValueError(f"{', '.join(chosen)} cannot be combined with algorithm.dynamic_sampling (DAPO's refill rounds "
                             "are rolled out per rank): turn one of them off")
        if self.trainer.async_steps:
            raise ValueError(f"{', '.join(chosen)} needs trainer.async_steps=0 (the schedule exchanges a step's rollouts "
                             "after its idle window, which the asynchronous mode does not have)")
        if self.pipeline.placement != "colocated":
            raise ValueError(f"{', '.join(chosen)} needs pipeline.placement=colocated")

    def _validate_weights(self) -> None:
        if self.engine.weights != "float32" and self.trainer.old_logprobs == "engine":
            raise ValueError("trainer.old_logprobs=engine is wrong with engine.weights=bfloat16: the engine serves the "
                             "bf16-rounded policy, not the actor's (train/mismatch_kl shows the gap); use "
                             "trainer.old_logprobs=actor or auto")
