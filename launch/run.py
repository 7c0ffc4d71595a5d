"""`build_run(cfg, ranks) -> Run`: every part of an RL run built once and connected explicitly.

The one place that assembles a run, for `python -m launch.train`, the benches (bench.runs) and
the tests: the rollout backend (engine.backend.RolloutBackend, native or vLLM), the actor and
its reference policy, the data loader, the step's sampling, the idle window's work (bubble
pre-generation and spot training, run by one common.idle.ScheduledIdle), the metrics logger and
the Trainer that runs the steps, each given exactly the parts it uses. `Run.train()` runs the
steps with evaluation, logging and checkpoints; `Run.close()` releases what the run started
(shared memory, process groups, vLLM's processes). `run(cfg, ranks)` does all three.

The run folder holds the resolved config, metrics.jsonl, lengths.jsonl, the W&B offline run,
checkpoints, dashboard.png, summary.txt and summary.json; rank 0 prints and every rank writes its
own log (`rank{r}.log`). `trainer.resume=runs/<run>/checkpoints/step-N` continues a run exactly
where it stopped; `run.dir=runs/<run> trainer.resume=auto` continues from that folder's latest
checkpoint, or starts fresh there if it has none (what a requeued Slurm job does).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from common.idle import ControlPlane, IdleSchedule, IdleWork, ScheduledIdle
from common.text import load_tokenizer, stop_tokens
from engine.backend import RolloutBackend
from engine.backends.factory import build_rollout_engine
from engine.spec.factory import history_store
from engine.types import Request
from launch.config import save_config, to_dict
from launch.run_config import TrainConfig
from pipeline.actors import build_actor
from pipeline.data import PromptLoader
from pipeline.data.chat import conversation
from pipeline.data.files import RowFields
from pipeline.data.sets import FileSets, file_sets
from pipeline.dist import Ranks, job_store
from pipeline.history import RunHistory
from pipeline.metrics import MetricsLogger
from pipeline.records_log import log_step, truncate_after
from pipeline.rollouts import StepSampling, encode_problem
from pipeline.run_state import RunState, latest_checkpoint, load_run
from pipeline.shares import split_samples
from pipeline.tasks import Problem, Task, get_task
from pipeline.tasks.eval import EVAL_SEED
from pipeline.tasks.reward_scoring import build_rewards
from pipeline.tasks.math import INSTRUCTION, unreadable_answer
from pipeline.trainer import StepDriver, Trainer, peak_rss_gb


class RankLog:
    """Rank 0 prints; every rank appends to its own file."""

    def __init__(self, run_dir: Path, r: Ranks) -> None:
        self.r, self.path = r, run_dir / f"rank{r.rank}.log"

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        with self.path.open("a") as f:
            f.write(line + "\n")
        if self.r.main:
            print(line, flush=True)


@dataclass
class Run:
    cfg: TrainConfig
    ranks: Ranks
    run_dir: Path
    log: RankLog
    task: Task
    held_out: list[Problem]
    held_out_source: str  # names the held-out set in the eval log (launch.run.RunProblems)
    loader: PromptLoader
    engine: RolloutBackend | None  # None on a separated run's actor ranks
    actor: object | None  # pipeline.actors.base.Actor; None on a separated run's rollout ranks
    idle_work: IdleWork | None  # a ScheduledIdle of bubble pre-generation and / or spot training
    trainer: StepDriver  # colocated: the Trainer; separated: this rank's side (launch.separated)
    logger: MetricsLogger
    start_step: int  # RL steps done before this process (a resumed run's checkpoint)
    resources: ExitStack = field(default_factory=ExitStack)  # closed by close(), last built first

    def train(self) -> dict:
        """Runs the remaining steps: eval before the first, every `trainer.eval_every` steps and at the
        end; metrics every step; checkpoints every `trainer.save_every` steps and at the end."""
        cfg, r, trainer, log = self.cfg, self.ranks, self.trainer, self.log
        tc = cfg.trainer
        accuracy: dict[int, float] = {}
        with self.logger:
            if self.start_step == 0:
                accuracy[0] = trainer.evaluate()
                if r.main:
                    self.logger.log(0, {"eval/accuracy": accuracy[0]})
                    log(f"held-out greedy accuracy before training: {accuracy[0]:.1%} on {self.held_out_source}")
            t0 = time.perf_counter()
            for _ in range(self.start_step, tc.steps):
                result = trainer.step()
                step = trainer.step_index
                log_step(self.run_dir, step, r.rank, result.decode_steps, result.rollouts)
                log(f"step {step}: peak RSS {peak_rss_gb():.2f} GB on rank {r.rank}")
                metrics = result.metrics
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    acc = trainer.evaluate()
                    if acc is not None:
                        metrics["eval/accuracy"] = accuracy[step] = acc
                self.logger.log(step, metrics, lengths=result.lengths)
                if (tc.save_every and step % tc.save_every == 0) or step == tc.steps:
                    trainer.save()
            train_s = time.perf_counter() - t0
        summary = {"run_dir": str(self.run_dir), "steps": tc.steps, "world_size": r.world, "train_seconds": round(train_s, 1),
                   "heldout_accuracy": {str(k): v for k, v in accuracy.items()}}
        if r.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            for name in ("dashboard.png", "summary.txt"):
                if (self.run_dir / name).exists():
                    log(f"wrote {self.run_dir / name}")
        return summary

    def close(self) -> None:
        self.resources.close()


def run(cfg: TrainConfig, r: Ranks) -> dict:
    """Builds the run, trains it, releases it; returns the summary (also in summary.json)."""
    built = build_run(cfg, r)
    try:
        return built.train()
    finally:
        built.close()


def build_run(cfg: TrainConfig, r: Ranks) -> Run:
    """Every part of the run from its config on this rank (collective: every rank calls it)."""
    resolve_resume(cfg, r)
    run_dir = run_dir_for(cfg, r)
    run_dir.mkdir(parents=True, exist_ok=True)
    if r.world > 1:
        dist.barrier()  # rank 0's look at run.dir (resolve_resume) happens before anyone logs into it
    log = RankLog(run_dir, r)
    if r.main and not cfg.trainer.resume:
        truncate_after(run_dir, -1)  # a fresh start in a fixed run.dir: an earlier attempt's lines go
        save_config(cfg, run_dir / "config.yaml")
    log(f"run {run_dir} on {r.world} rank(s)")
    torch.manual_seed(cfg.run.seed)
    resources = ExitStack()
    try:
        if cfg.pipeline.placement == "separated":
            from launch.separated import build_separated

            return build_separated(cfg, r, run_dir, log, resources)
        return _build(cfg, r, run_dir, log, resources)
    except BaseException:
        resources.close()
        raise


def _build(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack) -> Run:
    tokenizer = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tokenizer)
    for line in problems.summary:
        log(f"data: {line}")
    task, held_out = problems.task, problems.held_out
    loader = prompt_loader(cfg, problems.train, world_size=r.world, rank=r.rank)
    rewards = build_rewards(cfg.task, task, log)  # before any rollout: a reward that does not load stops the build
    resources.callback(rewards.close)
    log(rewards.summary())
    history = history_of(cfg, r)
    engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed,
                                  history=history.store if history is not None else None)
    resources.callback(engine.close)
    if cfg.engine.products == "auto" and cfg.engine.backend == "native":
        log(f"engine.products=auto: the rollout's products run in "
            f"{'bf16' if cfg.engine.bf16_products() else 'float32'} on this machine")
    sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tokenizer))
    actor = build_actor(cfg.actor, cfg.model.path)
    if (schedule := cfg.actor.schedule_summary(cfg.trainer.steps)) is not None:
        log(schedule)
    if cfg.actor.precision == "auto":
        from pipeline.actors.precision import resolve

        log(f"actor.precision=auto: the update runs {resolve(cfg.actor)} on this machine")
    reference = None
    if cfg.algorithm.kl_coef > 0:
        from pipeline.reference import ReferencePolicy

        reference = ReferencePolicy(cfg.actor, cfg.model.path)
    resume, state = resume_state(cfg, r, run_dir, log)
    if resume is not None:
        actor.load(resume / "actor")
        loader.load_state_dict(state.loader)
        if engine.policy is not None and "spec_policy" in state.components:
            engine.policy.load_state_dict(state.components["spec_policy"])
        if history is not None and "history" in state.components:
            history.load_state_dict(state.components["history"])
    idle_work, bubbles, spot = _build_idle(cfg, r, run_dir, log, resources, engine, tokenizer, loader, sampling, resume)
    if idle_work is not None and "idle_work" in state.components:
        idle_work.load_state_dict(state.components["idle_work"])

    trainer = Trainer(cfg, r, engine, actor, tokenizer, rewards, loader, held_out, run_dir, idle_work=idle_work,
                      start_step=state.step, reference=reference, bubbles=bubbles,
                      actor_features=spot.actor_features if spot is not None else None, sampling=sampling, history=history)
    if "length_predictor" in state.components:
        trainer.schedule.load_state_dict(state.components["length_predictor"])
    trainer.sync(version=state.step)  # the engine serves exactly the actor's weights (a resumed run's too)
    logger = MetricsLogger.from_config(run_dir, cfg.metrics, rank=r.rank, run_name=run_dir.name,
                                       resolved_config=to_dict(cfg),
                                       resume_after_step=state.step if resume is not None else -1)  # -1: a fresh start drops an earlier attempt's lines
    return Run(cfg=cfg, ranks=r, run_dir=run_dir, log=log, task=task, held_out=held_out,
               held_out_source=problems.held_out_source, loader=loader, engine=engine, actor=actor, idle_work=idle_work,
               trainer=trainer, logger=logger, start_step=state.step, resources=resources)


def history_of(cfg: TrainConfig, r: Ranks) -> RunHistory | None:
    """The history drafter's store, kept across steps by the run, when engine.spec.drafter has a history part."""
    spec = cfg.engine.spec
    if not spec.enabled or spec.drafter_spec.history is None:
        return None
    return RunHistory(history_store(spec), r, spec.drafter_spec.history)


def _build_idle(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack, engine: RolloutBackend,
                tokenizer, loader: PromptLoader, sampling: StepSampling, resume: Path | None):
    """The idle window's work: bubble pre-generation and / or spot training under one schedule
    (None when neither is on); -> (the work, the bubble store or None, the spot run or None)."""
    store = job_store(r)
    spot = None
    if cfg.spot.enabled:
        from spot.colocated import build_spot_work

        spot = build_spot_work(cfg.spot, engine, run_name=run_dir.name, rank=r.rank, local_rank=r.local_rank, world=r.world,
                               seed=cfg.run.seed, max_new_tokens=cfg.rollout.max_new_tokens, store=store, resume=resume)
        resources.callback(spot.close)
        log(f"spot training on: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB), drafter trained in idle windows")

    bubbles = bubble = None
    if cfg.bubble.enabled:
        from pipeline.bubble import BubbleStore, BubbleWork

        bubbles = BubbleStore(cfg.bubble.max_tokens)

        split = cfg.rollout.split_groups and r.world > 1
        samples = split_samples(cfg.rollout.n, r.world, r.rank) if split else range(cfg.rollout.n)

        def requests_for() -> list[Request]:  # what this rank rolls out next step: its shard, or its part of every group
            problems = loader.global_step() if split else loader.peek()
            return [Request(prompt_id=p.id, prompt=encode_problem(tokenizer, p, cfg.task.chat), n=len(samples),
                            first_sample=samples.start) for p in problems]

        control = ControlPlane(store, r.rank, r.world) if store is not None else None
        bubble = BubbleWork(engine, requests_for, sampling, bubbles, cfg.bubble, control)

    if spot is None and bubble is None:
        return None, None, None
    schedule = IdleSchedule(pregenerate=bubble is not None, train=spot is not None, share=cfg.bubble.share)
    return ScheduledIdle(schedule, bubble, spot.work if spot is not None else None), bubbles, spot


def resume_state(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog) -> tuple[Path | None, RunState]:
    """The checkpoint to continue from (None: a fresh start) and its state; rank 0 drops the run
    folder's records of the steps about to be redone."""
    resume = Path(cfg.trainer.resume) if cfg.trainer.resume else None
    if resume is None:
        return None, RunState(step=0, loader={}, engine_version=0)
    state = load_run(resume)
    if r.main:
        truncate_after(run_dir, state.step)
    log(f"resumed from {resume} at step {state.step}")
    return resume, state


def resolve_resume(cfg: TrainConfig, r: Ranks) -> None:
    """trainer.resume=auto becomes run.dir's latest complete checkpoint (rank 0 looks), or None."""
    if cfg.trainer.resume != "auto":
        return
    found = [latest_checkpoint(cfg.run.dir)]
    if r.world > 1:
        dist.broadcast_object_list(found, src=0)
    cfg.trainer.resume = str(found[0]) if found[0] is not None else None


def run_dir_for(cfg: TrainConfig, r: Ranks) -> Path:
    """The run folder: run.dir, or chosen by rank 0 (its timestamp) and told to the others; a resumed
    run keeps its folder."""
    if cfg.trainer.resume:
        return Path(cfg.trainer.resume).resolve().parent.parent
    if cfg.run.dir:
        return Path(cfg.run.dir)
    name = [f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if r.world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(cfg.run.out_dir) / name[0]


@dataclass(frozen=True)
class RunProblems:
    task: Task
    train: list[Problem]
    held_out: list[Problem]
    held_out_source: str  # the eval log's name for the held-out set: its file or generator, and counts
    summary: list[str]  # what the data files held (rows, bad rows, the split), for the run's log


def problems_for(cfg: TrainConfig, tokenizer) -> RunProblems:
    """The task, its training problems (generated, or task.file's rows) and the held-out set
    (task.eval_file's, a share of task.file's, or a generated task's test problems); in a chat run
    each problem carries the conversation it is rendered as (pipeline.data.chat)."""
    tc = cfg.task
    task = get_task(tc.name)
    sets = FileSets(train=None, held_out=None, reports=())
    if tc.file or tc.eval_file:
        fields = RowFields(prompt=tc.prompt_field, answer=tc.answer_field, id=tc.id_field, response=tc.response_field)
        sets = file_sets(tc.file, tc.eval_file, eval_share=tc.held_out_share, eval_problems=tc.eval_problems,
                         fields=fields, max_bad_share=tc.max_bad_share, check=_row_check(cfg, tokenizer))
    if sets.train is not None:
        train = sets.train
    else:
        shape = {k: v for k, v in (("max_digits", tc.max_digits), ("tail", tc.tail)) if v is not None}
        train = task.make_problems("train", tc.train_problems, cfg.run.seed, **shape)
    if sets.held_out is not None:
        held, source = sets.held_out.problems, sets.held_out.source
    else:
        held = task.make_problems("test", tc.eval_problems, EVAL_SEED)
        source = f"the {task.name} task's generated test problems ({len(held)})"
    chatted = _chat_form(cfg)
    return RunProblems(task=task, train=[chatted(p) for p in train], held_out=[chatted(p) for p in held],
                       held_out_source=source, summary=sets.summary())


def _chat_form(cfg: TrainConfig):
    """problem -> the problem as the run renders it: with its conversation in a chat run."""
    tc = cfg.task
    if not tc.chat:
        return lambda p: p
    instruction = tc.instruction or INSTRUCTION
    return lambda p: replace(p, messages=conversation(p, system_prompt=tc.system_prompt, instruction=instruction))


def _row_check(cfg: TrainConfig, tokenizer):
    """problem -> what makes a data row unusable, or None: chat messages in a run that is not a chat
    run, an answer math-verify cannot read (where it is the reward), a prompt longer than the engine's room (engine.max_len
    less rollout.max_new_tokens, which the engine would otherwise take from the response)."""
    tc = cfg.task
    room = cfg.engine.max_len - cfg.rollout.max_new_tokens
    if room < 1:
        raise ValueError(f"engine.max_len ({cfg.engine.max_len}) leaves no room for a prompt beside "
                         f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}): raise engine.max_len")
    chatted = _chat_form(cfg)
    math_verify = tc.reward == "math_verify" or (tc.reward is None and tc.name == "math")  # a plug-in reads its own answers

    def check(problem: Problem) -> str | None:
        if problem.messages and not tc.chat:
            return "the prompt is chat messages, which only a chat run renders: set task.chat=true"
        if math_verify and (reason := unreadable_answer(problem.answer)):
            return reason
        length = len(encode_problem(tokenizer, chatted(problem), tc.chat))
        if length > room:
            return (f"the prompt is {length} tokens{' in the chat template' if tc.chat else ''}, and the engine has "
                    f"room for {room} (engine.max_len {cfg.engine.max_len} - rollout.max_new_tokens "
                    f"{cfg.rollout.max_new_tokens}): raise engine.max_len, lower rollout.max_new_tokens, or drop the row")
        return None

    return check


def prompt_loader(cfg: TrainConfig, problems: list[Problem], *, world_size: int = 1, rank: int = 0) -> PromptLoader:
    """The run's PromptLoader over `problems` (world_size / rank: whose shard; 1 / 0: the global step).

    trainer.prompt_order=stratified sizes each problem by the characters of its reference response.
    """
    sizes = None
    if cfg.trainer.prompt_order == "stratified":
        bare = [p.id for p in problems if not p.response]
        if bare:
            raise ValueError(f"trainer.prompt_order=stratified sizes problems by their reference response, and "
                             f"{len(bare)} of {len(problems)} have none (first: {bare[0]}; a data file's rows carry one in "
                             "task.response_field): use trainer.prompt_order=shuffled")
        sizes = [len(p.response) for p in problems]
    return PromptLoader(problems, cfg.trainer.prompts_per_step, cfg.run.seed, world_size=world_size, rank=rank,
                        sizes=sizes)
