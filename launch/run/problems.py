"""The run's problems and its prompt loader, from the task and trainer sections.

`problems_for(cfg, tokenizer)`: the task, its training problems (generated, or task.file's rows)
and the held-out set, each rendered as the run renders it (a chat run's conversation), with the
rows a run cannot use refused by name; `prompt_loader(cfg, problems)`: the loader of the run's
step order (trainer.prompt_order, auto decided here and logged) over them. Both placements' builders (launch.run.colocated,
launch.run.separated), the warm start and the benches read the same problems through these two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from launch.run.config import TrainConfig
from pipeline.data import PromptLoader
from pipeline.data.chat import conversation, encode_problem
from pipeline.data.files import RowFields
from pipeline.data.sets import FileSets, file_sets
from pipeline.tasks import Problem, Task, get_task
from pipeline.tasks.eval import EVAL_SEED
from pipeline.tasks.math import INSTRUCTION, unreadable_answer
from pipeline.tasks.reward_plugins import uses_math_verify


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
    math_verify = uses_math_verify(tc)  # a plug-in reads its own answers

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


def prompt_loader(cfg: TrainConfig, problems: list[Problem], *, world_size: int = 1, rank: int = 0,
                  log: Callable[[str], None] | None = None) -> PromptLoader:
    """The run's PromptLoader over `problems` (world_size / rank: whose shard; 1 / 0: the global step);
    `log` is told which order trainer.prompt_order chose and why.

    A stratified order sizes each problem by the characters of its reference response.
    """
    order, why = prompt_order(cfg, problems)
    if log is not None:
        log(f"prompt order: {order} ({why})")
    sizes = [len(p.response) for p in problems] if order == "stratified" else None
    return PromptLoader(problems, cfg.trainer.prompts_per_step, cfg.run.seed, world_size=world_size, rank=rank,
                        sizes=sizes)


def prompt_order(cfg: TrainConfig, problems: list[Problem]) -> tuple[str, str]:
    """(shuffled | stratified, why): trainer.prompt_order, with auto decided by whether every problem
    has a reference response to size it by. ValueError for stratified over problems without one."""
    chosen = cfg.trainer.prompt_order
    bare = [p.id for p in problems if not p.response]
    if chosen == "shuffled":
        return "shuffled", "trainer.prompt_order=shuffled"
    if not bare:
        return "stratified", f"trainer.prompt_order={chosen}: every problem has a reference response to size it by"
    if chosen == "auto":
        return "shuffled", (f"trainer.prompt_order=auto: {len(bare)} of {len(problems)} problems have no reference "
                            "response to size a stratified order by (a data file's rows carry one in task.response_field)")
    raise ValueError(f"trainer.prompt_order=stratified sizes problems by their reference response, and "
                     f"{len(bare)} of {len(problems)} have none (first: {bare[0]}; a data file's rows carry one in "
                     "task.response_field): use trainer.prompt_order=shuffled (or auto, which shuffles them)")
