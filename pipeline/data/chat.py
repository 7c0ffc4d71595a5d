"""Chat prompts: prompts given as chat messages, the conversation a chat run renders, its tokens.

A data row's prompt is *text* (a question) or *messages*: a list of `{"role", "content"}` objects,
as verl and TRL's conversational datasets store them (DAPO-Math-17k: one user turn). A chat run
(`task.chat`) renders every problem as a *conversation*: (role, content) *turns* ending with
the user's, in the tokenizer's own chat template, ready for the assistant's reply.

- A text prompt becomes an optional system turn (`task.system_prompt`) and one user turn made
  by the *instruction template*: the template with `{prompt}` replaced by the question (the math
  task's default asks for the answer in `\\boxed{}`, what its reward reads).
- Messages are the conversation as the file gives it, instruction included (a verl user's
  prompts already say how to answer): the template is not applied; the system prompt goes
  before them only where they hold no system turn of their own.

This module knows nothing about files or configs: the caller passes the system prompt and the
template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.tasks.arith import Problem

Turns = tuple[tuple[str, str], ...]  # (role, content), ending with the user's turn
ROLES = ("system", "user", "assistant")
PLACEHOLDER = "{prompt}"


def parse_messages(value: Any) -> Turns:
    """A row's messages as turns; ValueError saying what is wrong with them."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"chat messages must be a non-empty list of {{\"role\", \"content\"}} objects, got {value!r:.80}")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"message {i} must be an object with a string \"role\" and a \"content\", got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}'s content must be a string (text only), got {type(m['content']).__name__}")
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "user" or not turns[-1][1].strip():
        raise ValueError(f"the last message must be a non-empty user turn (the assistant replies to it), got a "
                         f"{turns[-1][0]} turn {turns[-1][1]!r:.60}")
    return tuple(turns)


def check_instruction(template: str) -> None:
    if template.count(PLACEHOLDER) != 1:
        raise ValueError(f"an instruction template holds {PLACEHOLDER} exactly once (where the question goes), "
                         f"got {template!r}")


def conversation(problem: Problem, *, system_prompt: str | None, instruction: str) -> Turns:
    """The turns a chat run renders for `problem` (the module's docstring says which)."""
    if problem.messages:
        if system_prompt and all(role != "system" for role, _ in problem.messages):
            return (("system", system_prompt),) + problem.messages
        return problem.messages
    check_instruction(instruction)
    user = ("user", instruction.replace(PLACEHOLDER, problem.prompt))
    return (("system", system_prompt), user) if system_prompt else (user,)


def render(tokenizer: Any, turns: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of `turns` in the tokenizer's chat template, with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, and a chat prompt needs one (task.chat=true, or a "
                         "data file whose prompts are chat messages): use a chat model's folder, or task.chat=false "
                         "with text prompts")
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_problem(tokenizer: Any, problem: Problem, chat: bool) -> list[int]:
    """The prompt's token ids: in a chat run its conversation (`problem.messages`, which
    launch.run.problems.problems_for gives every problem of a chat run) rendered, else its text encoded."""
    if chat:
        if not problem.messages:
            raise ValueError(f"problem {problem.id!r} has no conversation to render in a chat run: build the run's "
                             "problems with launch.run.problems.problems_for, which gives each its turns")
        return render(tokenizer, problem.messages)
    if problem.messages:
        raise ValueError(f"problem {problem.id!r} is chat messages, which only a chat run renders: set task.chat=true")
    return list(tokenizer(problem.prompt)["input_ids"])
