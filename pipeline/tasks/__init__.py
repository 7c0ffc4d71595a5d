"""Tasks: problems with verifiable answers and their rewards.

A `Task` bundles a problem generator and an exact-answer reward, and for the synthetic tasks a
careless teacher (and for mult a checking one) whose demonstrations pretraining may mix in.
`Problem` records flow from here to the rollout stage; the reward is a pure function of a response
text and the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.tasks import arith, make_math, math, mult
from pipeline.tasks.arith import Problem


@dataclass(frozen=True)
class Task:
    name: str
    make_problems: Callable[..., list[Problem]]  # (split, num, seed, *, start=0) -> problems
    reward: Callable[[str, str], float]  # (response text, answer) -> reward
    # problem -> a careless teacher's worked response, wrong on some problems; None: no such teacher
    careless: Callable[[Problem], str] | None = None
    # (problem, careless first pass?) -> a response that answers, then checks by working the
    # problem again carefully (pipeline.tasks.mult); None: no such teacher
    checking: Callable[[Problem, bool], str] | None = None


def _arith_careless(problem: Problem) -> str:
    return arith.careless_solution(*arith.operands(problem.prompt))


def _mult_careless(problem: Problem) -> str:
    return mult.careless_solution(problem.prompt)


def _mult_checking(problem: Problem, careless: bool) -> str:
    return mult.checked_solution(problem.prompt, careless=careless)


TASKS = {"arith": Task(name="arith", make_problems=arith.make_problems, reward=arith.reward, careless=_arith_careless),
         "math": Task(name="math", make_problems=make_math.make_problems, reward=math.reward),
         "mult": Task(name="mult", make_problems=mult.make_problems, reward=mult.reward, careless=_mult_careless,
                         checking=_mult_checking)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return TASKS[name]


__all__ = ["Problem", "TASKS", "Task", "get_task"]
