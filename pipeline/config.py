"""The loop's config sections: `task:`, `rollout:`, `trainer:` and `pipeline:` in configs/*.yaml.

Each part of the loop receives the sections it reads (pipeline.trainer, pipeline.update.learner, the
separated sides, pipeline.rollout.schedule), never the whole run config: launch.run.config.TrainConfig
assembles these with the other parts' sections (engine.config, pipeline.actors.base,
pipeline.algorithms.config, spot.config, ...) and checks what spans several of them. Each
section's `validate()` checks its own keys, raising ValueError naming the key.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

from pipeline.tasks.reward_plugins import check_reward_name


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
    response_field: str | None = None  # a worked solution, if the rows have one (trainer.prompt_order=stratified / auto)
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
    # The training reward (pipeline.tasks.reward_plugins): null, the task's own (run in this process);
    # math_verify (math_verify(format_weight=0.2): + 0.2 for a \boxed{} answer in training; held-out
    # accuracy scores correctness only), exact, path/to/file.py:function or package.module:function
    # (written fn(prompt, response, answer, extra), as verl's compute_score(data_source, solution_str,
    # ground_truth, extra_info) or as TRL's reward_func(prompts, completions, **kwargs)), or a list of
    # them summed with task.reward_weights (TRL's reward_weights; null: each 1).
    reward: str | list[str] | None = None
    reward_weights: list[float] | None = None
    # The former spelling of math_verify's bonus: read as task.reward=math_verify(format_weight=W) where
    # math-verify is the reward, ignored (with a warning) beside another reward; null: not given.
    format_weight: float | None = None
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
        self._migrate_format_weight()
        check_reward_name(self.reward, self.reward_weights)
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

    def _migrate_format_weight(self) -> None:
        """task.format_weight=W becomes task.reward=math_verify(format_weight=W) where math-verify is the
        reward (task.reward math_verify, or null on a math-verify task); beside another reward it is
        math-verify's option of a reward the run does not use, so it is dropped with a warning."""
        weight, self.format_weight = self.format_weight, None
        if weight is None:
            return
        if weight < 0:
            raise ValueError(f"task.format_weight must be >= 0, got {weight} (write task.reward=math_verify(format_weight=W))")
        math_task = self.name == "math" or bool(self.file)
        if self.reward == "math_verify" or (self.reward is None and math_task):
            if weight > 0:
                self.reward = f"math_verify(format_weight={weight:g})"
                warnings.warn(f"task.format_weight={weight:g} is read as task.reward={self.reward}; write that instead",
                              FutureWarning, stacklevel=2)
            return
        if weight > 0:
            if self.reward is None:
                raise ValueError(f"task.format_weight is math-verify's bonus for a \\boxed{{}} answer, and the {self.name} "
                                 "task's own reward is not math-verify: drop task.format_weight, or set "
                                 f"task.reward=math_verify(format_weight={weight:g})")
            warnings.warn(f"task.format_weight={weight:g} is ignored: it is math-verify's bonus for a \\boxed{{}} answer, "
                          f"and task.reward={self.reward} is another reward (drop task.format_weight; with math-verify "
                          f"write task.reward=math_verify(format_weight={weight:g}))", UserWarning, stacklevel=2)

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
    # instead of each rolling out its loader shard (pipeline.rollout.stealing); the tokens are the same.
    work_stealing: bool = False
    # Rows a rank keeps active while groups remain in the queue; 0: 7/8 of its share of the step's
    # rows (pipeline.rollout.stealing.default_inflight).
    steal_inflight: int = 0
    # Groups start in order of predicted length, longest first (their responses the last time the
    # prompt was seen, else the running mean: pipeline.rollout.lengths); the tokens are the same.
    long_first: bool = False
    # Every rank generates its part of every prompt's group (rank r: samples r*n/w .. (r+1)*n/w - 1
    # of each, w ranks; a separated run's w rollout ranks likewise), instead of whole groups of its
    # share: the step's longest group is spread over all ranks, so they finish together (Seer's
    # divided rollout; pipeline.rollout.schedule, pipeline.separated.rollout). Each rank prefills every
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
    # Checkpoints kept on disk: the K latest and the one of best held-out accuracy (pipeline.checkpoint.keep);
    # 0 keeps every one. The preflight sizes the run folder's disk by it.
    keep_checkpoints: int = 0
    # A checkpoint folder (runs/<run>/checkpoints/step-N) to continue from, or "auto": the run folder's
    # (run.dir's) latest complete checkpoint if it has one, else a fresh start (requeued Slurm jobs).
    resume: str | None = None
    # Old log-probs of the PPO ratio (pipeline/update/old_logprobs.py): engine, the engine's own (the
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
    # auto: stratified where every training problem has a reference response (generated tasks, a file
    # with task.response_field), else shuffled; the run's log says which (launch.run.problems).
    prompt_order: Literal["auto", "shuffled", "stratified"] = "shuffled"
    # Rows whose advantage is 0 on every token (a GRPO / RLOO group whose rewards are all equal)
    # give the policy loss no gradient when algorithm.kl_coef is 0: the update's forward and
    # backward leave them out (the loss weights still count them, so the step's gradient is the
    # same sum). false: every row goes through the actor.
    skip_zero_advantage: bool = True

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step", "ppo_epochs", "mini_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("eval_every", "save_every", "keep_checkpoints"):
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


@dataclass(frozen=True)
class PlacementCapabilities:
    """What a placement's loops can run, declared per placement (PLACEMENTS) as the actor and engine
    backends declare theirs; the run's validation (launch.run.capabilities) reads them."""

    pregenerates: bool  # a rank idles between its rollouts and its update (bubble drafts fill that wait)
    refills: bool  # the ranks that train also roll out more rounds of a step (algorithm.dynamic_sampling)
    balances: bool  # a step's rollouts and groups are dealt across the ranks that both make and train them
    actor_on_every_rank: bool  # the actor trains on every rank of the job, not on a subgroup
    actor_beside_engine: bool  # each rank that rolls out also holds the actor (its features for spot training)


PLACEMENTS = {
    "colocated": PlacementCapabilities(pregenerates=True, refills=True, balances=True, actor_on_every_rank=True,
                                       actor_beside_engine=True),
    "separated": PlacementCapabilities(pregenerates=False, refills=False, balances=False, actor_on_every_rank=False,
                                       actor_beside_engine=False),
}


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

    @property
    def separated(self) -> bool:
        """Whether actor ranks and rollout ranks are different processes."""
        return self.placement == "separated"

    @property
    def caps(self) -> PlacementCapabilities:
        """What this placement's loops can run."""
        return PLACEMENTS[self.placement]

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"pipeline.timeout_s must be > 0, got {self.timeout_s}")
        if not self.separated and self.actor_ranks:
            raise ValueError(f"pipeline.actor_ranks={self.actor_ranks} is for pipeline.placement=separated; drop it or "
                             "set pipeline.placement=separated")
        if self.separated and self.actor_ranks < 1:
            raise ValueError("pipeline.placement=separated needs pipeline.actor_ranks >= 1 (the ranks that train; the "
                             "others roll out)")

    def roles(self, world: int) -> tuple[int, int]:
        """(actor ranks, rollout ranks) in a job of `world` processes; colocated: every rank is both."""
        if not self.separated:
            return world, world
        if self.actor_ranks >= world:
            raise ValueError(f"pipeline.actor_ranks={self.actor_ranks} leaves no rollout rank in a job of {world} "
                             f"processes: use at most {world - 1}, or start more processes (torchrun --nproc-per-node)")
        return self.actor_ranks, world - self.actor_ranks
