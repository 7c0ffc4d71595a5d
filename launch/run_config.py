"""The run config: one section per component, loaded from configs/*.yaml (launch.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.backends.vllm_config import VLLM_METHODS, vllm_network
from engine.config import EngineConfig
from launch.cluster_config import ClusterSection
from pipeline.actors.base import ActorConfig
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.bubble import BubbleConfig
from pipeline.metrics.config import MetricsConfig
from pipeline.tasks.reward_plugins import check_reward_name
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
class TaskSection:
    name: str = "arith"  # arith | mult | math: the reward, and the problems when no task.file is given
    # Training problems from a JSONL / JSON / parquet file (pipeline.data; `python -m pipeline.data.prepare`
    # converts GSM8K, MATH, verl / DAPO and TRL layouts), instead of the task's generator.
    file: str | None = None
    # Field paths into each row: a key, or keys joined by dots into nested objects (verl's parquet:
    # prompt_field=prompt, answer_field=reward_model.ground_truth). A prompt is text, or a list of
    # {"role", "content"} chat messages (rendered as given: set task.chat=true).
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: str | None = "id"  # a row without it (or null here) gets a hash of its prompt as its id
    response_field: str | None = None  # a worked solution, if the rows have one (trainer.prompt_order=stratified)
    max_bad_share: float = 0.01  # stop when more rows than this share are malformed (each is logged as file:line)
    # The held-out set: a file of its own (the same fields), or this share of task.file held out by
    # a hash of each id (the same on every run and rank, never trained on). null: 0.05 for a file
    # run without task.eval_file, else 0. Without either, the task's generated test problems (the
    # built-in tasks only: a file run always evaluates on the user's data).
    eval_file: str | None = None
    eval_share: float | None = None
    chat: bool = False  # render each problem in the tokenizer's chat template
    # Chat runs: a system turn before each prompt (a row's own system message wins), and the user
    # turn made from a text prompt, "{prompt}" standing for it. null: the question, then "Put your
    # final answer within \boxed{}." (what the math reward reads). Chat-message prompts are
    # rendered as given, without the instruction.
    system_prompt: str | None = None
    instruction: str | None = None
    format_weight: float = 0.0  # training reward bonus for a \boxed{} answer (math-verify tasks); eval scores correctness
    # The training reward (pipeline.tasks.reward_plugins): null, the task's own (run in this process);
    # math_verify, exact, path/to/file.py:function or package.module:function, each called as
    # fn(prompt, response, answer, extra) -> float | {"score": float, <metric>: float, ...}.
    reward: str | None = None
    reward_workers: int = 2  # worker processes a named reward runs in; 0: this process, without timeouts
    reward_timeout_s: float = 10.0  # a call running longer is abandoned (its worker replaced) and scores 0
    # A rank's step whose failed reward calls (raised or timed out: each scores 0, counted in
    # reward/errors and reward/timeouts) exceed this share stops the run, showing one failing row.
    max_reward_error_share: float = 0.1
    train_problems: int = 4096  # problems drawn from a generator for training
    # arith only: the training problems' difficulty (operand digits 1..max_digits, P(d) ~ d^-tail);
    # None: the generator's defaults (12, 1.5), which the held-out problems always use.
    max_digits: int | None = None
    tail: float | None = None
    # Held-out problems evaluated (greedy accuracy): a file's, the ones of smallest id hash (a fixed sample).
    eval_problems: int = 200
    eval_max_new_tokens: int | None = None  # None: rollout.max_new_tokens

    def validate(self) -> None:
        if self.eval_problems < 1 or self.train_problems < 1:
            raise ValueError("task.eval_problems and task.train_problems must be >= 1")
        if (self.max_digits is not None or self.tail is not None) and (self.name != "arith" or self.file):
            raise ValueError("task.max_digits / task.tail shape the arith generator only (task.name=arith, no task.file)")
        if self.format_weight < 0:
            raise ValueError(f"task.format_weight must be >= 0, got {self.format_weight}")
        check_reward_name(self.reward)
        if self.reward_workers < 0:
            raise ValueError(f"task.reward_workers must be >= 0 (0: the reward runs in the trainer's process), got "
                             f"{self.reward_workers}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"task.reward_timeout_s must be > 0 seconds, got {self.reward_timeout_s}")
        if not 0 <= self.max_reward_error_share < 1:
            raise ValueError(f"task.max_reward_error_share must be in [0, 1), got {self.max_reward_error_share}")
        if not 0 <= self.max_bad_share < 1:
            raise ValueError(f"task.max_bad_share must be in [0, 1), got {self.max_bad_share}")
        for key in ("file", "eval_file", "prompt_field", "answer_field", "id_field", "response_field"):
            if getattr(self, key) == "":
                raise ValueError(f"task.{key} is empty: give a value or null")
        if self.eval_share is not None:
            if not 0 < self.eval_share < 1:
                raise ValueError(f"task.eval_share must be in (0, 1) (null: the default), got {self.eval_share}")
            if not self.file or self.eval_file:
                raise ValueError("task.eval_share holds out a share of task.file: give it with task.file and "
                                 "without task.eval_file (which is then the held-out set)")
        if not self.chat and (self.system_prompt is not None or self.instruction is not None):
            raise ValueError("task.system_prompt and task.instruction shape chat prompts: set task.chat=true, or "
                             "leave them null")
        if self.instruction is not None and self.instruction.count("{prompt}") != 1:
            raise ValueError(f"task.instruction must hold {{prompt}} exactly once (where the question goes), got "
                             f"{self.instruction!r}")

    @property
    def held_out_share(self) -> float:
        """The share of task.file held out for evaluation (eval_share, or its default)."""
        if self.eval_share is not None:
            return self.eval_share
        return 0.05 if self.file and not self.eval_file else 0.0


@dataclass(kw_only=True)
class RolloutSection:
    n: int = 4  # samples per prompt (a GRPO group)
    max_new_tokens: int = 384
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Ranks take the step's prompt groups from one queue in the job's store as their rows free up,
    # instead of each rolling out its loader shard (pipeline.stealing); the tokens are the same.
    work_stealing: bool = False
    # Rows a rank keeps active while groups remain in the queue; 0: 7/8 of its share of the step's
    # rows (pipeline.stealing.default_inflight).
    steal_inflight: int = 0
    # Groups start in order of predicted length, longest first (their responses the last time the
    # prompt was seen, else the running mean: pipeline.lengths); the tokens are the same.
    long_first: bool = False
    # Every rank generates its part of every prompt's group (rank r: samples r*n/w .. (r+1)*n/w - 1
    # of each, w ranks; a separated run's w rollout ranks likewise), instead of whole groups of its
    # share: the step's longest group is spread over all ranks, so they finish together (Seer's
    # divided rollout; pipeline.schedule, pipeline.separated_rollout). Each rank prefills every
    # prompt. The tokens are the same; the groups are joined before the update.
    split_groups: bool = False

    def validate(self) -> None:
        if self.work_stealing and self.split_groups:
            raise ValueError("rollout.work_stealing and rollout.split_groups are two ways to balance a step's rollouts "
                             "over the ranks (queued groups, or every group split): turn one of them off")
        if self.steal_inflight < 0:
            raise ValueError(f"rollout.steal_inflight must be >= 0 (0: 7/8 of a rank's share of the rows), "
                             f"got {self.steal_inflight}")
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(kw_only=True)
class TrainerSection:
    steps: int = 20  # RL steps
    prompts_per_step: int = 32  # over all ranks (each rank rolls out prompts_per_step / world size)
    ppo_epochs: int = 1  # passes over a step's rollouts
    mini_batches: int = 1  # optimizer steps per PPO epoch
    eval_every: int = 5  # held-out accuracy every N steps (and before the first, after the last); 0 = only those
    save_every: int = 0  # checkpoint every N steps (and after the last); 0 = only after the last
    # A checkpoint folder (runs/<run>/checkpoints/step-N) to continue from, or "auto": the run folder's
    # (run.dir's) latest complete checkpoint if it has one, else a fresh start (requeued Slurm jobs).
    resume: str | None = None
    # Old log-probs of the PPO ratio (pipeline/old_logprobs.py): engine, the engine's own (the
    # behaviour policy's, free: exactly the old policy in synchronous mode when the sampling
    # distribution is the policy's: temperature 1, no top-k / top-p); update, the update's own
    # forward, detached, for the rows it passes before any optimizer step (all of them with one
    # mini-batch and one epoch), and one actor forward over the later mini-batches' rows; actor, one
    # actor forward over every row before the update. auto: engine where it holds, else update,
    # else (async_steps=1, or spot training from the actor's features) actor.
    old_logprobs: Literal["auto", "actor", "engine", "update"] = "auto"
    async_steps: Literal[0, 1] = 0  # 1: step t+1's rollouts use the policy before step t's update
    is_cap: float = 2.0  # truncated importance weight cap of the asynchronous mode
    # Which prompt groups each rank trains (pipeline.shares): shard, its loader shard (whatever rank
    # generated them: with rollout.work_stealing too, the same run bit for bit); tokens, groups dealt
    # longest first to balance the ranks' update tokens (another, equally valid, run).
    train_shares: Literal["shard", "tokens"] = "shard"
    # Which problems share a step (pipeline.data): shuffled epochs, or stratified ones where every
    # step takes one problem of each size stratum, a problem's size being the length of its reference
    # response, so every step has the whole set's spread of lengths (its longest from the top stratum).
    prompt_order: Literal["shuffled", "stratified"] = "shuffled"
    # Rows whose advantage is 0 on every token (a GRPO / RLOO group whose rewards are all equal)
    # give the policy loss no gradient when algorithm.kl_coef is 0: the update's forward and
    # backward leave them out (the loss weights still count them, so the step's gradient is the
    # same sum). false: every row goes through the actor.
    skip_zero_advantage: bool = True

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step", "ppo_epochs", "mini_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("eval_every", "save_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key} must be >= 0, got {getattr(self, key)}")
        if self.old_logprobs == "engine" and self.async_steps:
            raise ValueError("trainer.old_logprobs=engine is wrong with trainer.async_steps=1 (the behaviour policy is "
                             "one update behind the old one); use actor or auto")
        if self.old_logprobs == "update" and self.async_steps:
            raise ValueError("trainer.old_logprobs=update is wrong with trainer.async_steps=1 (the rollouts come from the "
                             "policy one update behind; the importance weight needs the old log-probs before the "
                             "update): use actor or auto")
        if self.resume == "":
            raise ValueError("trainer.resume is empty: name a checkpoint folder, 'auto', or leave it null")
        if not self.is_cap >= 1:
            raise ValueError(f"trainer.is_cap must be >= 1, got {self.is_cap}")


@dataclass(kw_only=True)
class PipelineSection:
    """Where the run's work goes (docs/PLACEMENT.md). colocated: every rank rolls out, then trains
    (TLT's layout). separated: the first `actor_ranks` ranks train and push weights to the others,
    which hold the engines and roll out; a separated run equals the colocated run on
    `actor_ranks` ranks, bit for bit on CPU."""

    placement: Literal["colocated", "separated"] = "colocated"
    actor_ranks: int = 0  # separated only: ranks 0..K-1 train, ranks K..world-1 roll out
    # Seconds any collective or transfer may wait for a peer (every process group): a rank that
    # died ends the others' waits with an error after at most this long.
    timeout_s: float = 1800.0

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"pipeline.timeout_s must be > 0, got {self.timeout_s}")
        if self.placement == "colocated" and self.actor_ranks:
            raise ValueError(f"pipeline.actor_ranks={self.actor_ranks} is for pipeline.placement=separated; drop it or "
                             "set pipeline.placement=separated")
        if self.placement == "separated" and self.actor_ranks < 1:
            raise ValueError("pipeline.placement=separated needs pipeline.actor_ranks >= 1 (the ranks that train; the "
                             "others roll out)")

    def roles(self, world: int) -> tuple[int, int]:
        """(actor ranks, rollout ranks) in a job of `world` processes; colocated: every rank is both."""
        if self.placement == "colocated":
            return world, world
        if self.actor_ranks >= world:
            raise ValueError(f"pipeline.actor_ranks={self.actor_ranks} leaves no rollout rank in a job of {world} "
                             f"processes: use at most {world - 1}, or start more processes (torchrun --nproc-per-node)")
        return self.actor_ranks, world - self.actor_ranks


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
        if self.engine.backend == "vllm":
            self._validate_vllm()
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
            (self.spot.enabled and self.engine.backend != "native", "spot.enabled trains from the rollout engine's "
                                                                   "features: set engine.backend=native or spot.enabled=false"),
            (self.bubble.enabled, "bubble.enabled: pre-generation fills a colocated rank's idle window; set "
                                  "bubble.enabled=false"),
            (bool(self.algorithm.dynamic_sampling), "algorithm.dynamic_sampling (DAPO's refill rounds) is not supported "
                                                   "by the separated placement; set algorithm.dynamic_sampling=false"),
            (self.actor.backend == "megatron", "actor.backend=megatron builds its parallel groups over every rank of "
                                               "the job; train the actor ranks with actor.backend=deepspeed (ZeRO) or "
                                               "torch (DDP)"),
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
        if self.rollout.work_stealing and self.engine.backend != "native":
            raise ValueError("rollout.work_stealing feeds the engine from a queue as its rows free up, which only "
                             "engine.backend=native can do: set rollout.work_stealing=false with engine.backend=vllm")

    def _validate_weights(self) -> None:
        if self.engine.weights != "float32" and self.trainer.old_logprobs == "engine":
            raise ValueError("trainer.old_logprobs=engine is wrong with engine.weights=bfloat16: the engine serves the "
                             "bf16-rounded policy, not the actor's (train/mismatch_kl shows the gap); use "
                             "trainer.old_logprobs=actor or auto")

    def _validate_vllm(self) -> None:
        """What the loop cannot do with engine.backend=vllm (engine.backends.vllm_engine says why)."""
        if self.trainer.old_logprobs == "engine":
            raise ValueError("trainer.old_logprobs=engine needs engine.backend=native: vLLM's log-probs are not exactly "
                             "the old policy's (its numerics; train/mismatch_kl shows the gap); use "
                             "trainer.old_logprobs=actor or auto with engine.backend=vllm")
        if self.bubble.enabled:
            raise ValueError("bubble.enabled needs engine.backend=native: vLLM cannot preempt a generate call nor take "
                             "pre-generated drafts; set bubble.enabled=false with engine.backend=vllm")
        spec = self.engine.spec
        if self.spot.enabled and not (spec.enabled and vllm_network(spec.drafter_spec)):
            raise ValueError("spot.enabled with engine.backend=vllm trains the drafter vLLM serves: set "
                             f"engine.spec.enabled=true and engine.spec.drafter={' or '.join(VLLM_METHODS)} "
                             f"(got {spec.drafter!r})")
