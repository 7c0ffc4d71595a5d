"""Rewards as plug-ins: what `task.reward` names, loaded into one calling convention.

Every reward of a run is called once per rollout as

    fn(prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float | dict

- `prompt`: the problem's prompt as the task holds it (a data file's prompt field, a generated
  problem's text), not the chat-templated string the model was given;
- `response`: the decoded response, special tokens dropped;
- `answer`: the reference answer (a data file's answer field);
- `extra`: the row's other fields (`Problem.extra`: a data file's other columns; empty for the
  generated tasks).

It returns the score, or a dict holding the score under `score` and other entries that are
finite numbers: the metrics of that call, whose means over a step's calls are logged as
`reward/<key>` (a key the run logs itself, `mean`, `std`, `errors` or `timeouts`, is refused).
A score must be a finite number; the built-in rewards' must also lie in their bounds.

`task.reward` names the training reward:

- null: the task's own, `Task.reward(response, answer)` (arith and mult: the `#### N` line; math:
  math-verify), or with `task.format_weight > 0` math-verify plus that bonus for a `\\boxed{}`
  answer (math-verify tasks only);
- `math_verify`: `MathVerifyReward(format_weight=task.format_weight)` (pipeline.tasks.rewards);
- `exact`: `ExactAnswerReward`, the final answer compared as a string;
- `path/to/file.py:function`: a function in a Python file (a relative path is relative to the
  working directory);
- `package.module:function`: a function in an importable module.

The held-out reward is the training one without the format bonus: the task's own for null, the
plain `MathVerifyReward()` for math_verify, the same function for exact and plug-ins (held-out
accuracy is then the mean of the plug-in's `score`).

A plug-in is loaded here, at construction, so that a missing file, a missing function or a
wrong signature is a ValueError naming `task.reward` before any rollout; it is pickled by its
name, not its code, and loaded again in each reward worker (pipeline.tasks.reward_pool): a
file's module-level code runs once in every process that loads it. This module does not know
where rewards run (pipeline.tasks.reward_scoring decides).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.tasks.rewards import ExactAnswerReward, MathVerifyReward, Reward

SIGNATURE = "def {name}(prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float | dict"
FORMS = "null, math_verify, exact, <file.py>:<function> or <module>:<function>"


class RewardFunction(Protocol):
    name: str  # how messages name it
    bounds: tuple[float, float] | None  # a score outside it is an error; None: any finite number

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float | Mapping[str, Any]: ...


@dataclass(frozen=True)
class TaskReward:
    """A task's own `reward(response, answer) -> float` in the plug-in convention."""

    fn: Callable[[str, str], float]
    name: str
    bounds = None

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float:
        return self.fn(response, answer)


@dataclass(frozen=True)
class BuiltinReward:
    """A built-in `Reward` (pipeline.tasks.rewards) in the plug-in convention: its score, and its
    info's numbers and flags as metrics (math-verify's `correct` and `boxed`)."""

    reward: Reward

    @property
    def name(self) -> str:
        return self.reward.name

    @property
    def bounds(self) -> tuple[float, float]:
        return self.reward.bounds

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> dict[str, float]:
        score, info = self.reward(response, answer)
        return {"score": score, **{k: float(v) for k, v in info.items() if isinstance(v, (bool, int, float))}}


class PluginReward:
    """The function `source` names (`<file.py>:<function>` or `<module>:<function>`), loaded now and
    again wherever it is unpickled."""

    bounds = None

    def __init__(self, source: str) -> None:
        self.name = source
        where, _, function = source.rpartition(":")
        # a file's path is fixed against this working directory now, for workers that might run elsewhere
        self._target = f"{Path(where).resolve()}:{function}" if _is_file(where) else source
        self._fn = load_plugin(self._target, shown=source)

    def __getstate__(self) -> dict[str, str]:
        return {"name": self.name, "target": self._target}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.name, self._target = state["name"], state["target"]
        self._fn = load_plugin(self._target, shown=self.name)

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float | Mapping[str, Any]:
        return self._fn(prompt, response, answer, extra)


def reward_functions(task_cfg, task) -> tuple[RewardFunction, RewardFunction]:
    """(the training reward, the held-out reward) that `task_cfg.reward` names (task_cfg: the run's
    TaskSection; task: a pipeline.tasks.Task). ValueError naming `task.reward` for one that does
    not load."""
    choice, weight = task_cfg.reward, task_cfg.format_weight
    if weight and choice not in (None, "math_verify"):
        raise ValueError(f"task.format_weight is math-verify's bonus for a \\boxed{{}} answer, and task.reward={choice} "
                         "has none: set task.format_weight=0, or task.reward=math_verify")
    if choice is None:
        own = TaskReward(task.reward, f"the {task.name} task's reward")
        if weight == 0:
            return own, own
        if task.name != "math" and not task_cfg.file:
            raise ValueError(f"task.format_weight needs a math-verify task (task.name=math or task.file), not {task.name!r}")
        return BuiltinReward(MathVerifyReward(format_weight=weight)), own
    if choice == "math_verify":
        return BuiltinReward(MathVerifyReward(format_weight=weight)), BuiltinReward(MathVerifyReward())
    if choice == "exact":
        exact = BuiltinReward(ExactAnswerReward())
        return exact, exact
    plugin = PluginReward(choice)
    return plugin, plugin


def check_reward_name(choice: str | None) -> None:
    """ValueError naming `task.reward` when `choice` has none of the forms it can take (the config's
    check; loading comes at build)."""
    if choice is None or choice in ("math_verify", "exact"):
        return
    where, sep, function = choice.rpartition(":")
    if not (sep and where and function.isidentifier()):
        raise ValueError(f"task.reward={choice!r}: expected {FORMS}")


def load_plugin(target: str, shown: str | None = None) -> Callable[..., Any]:
    """The function `target` (`<file.py>:<function>` or `<module>:<function>`) names, checked to
    take (prompt, response, answer, extra); ValueError naming `task.reward` (as `shown`) if not."""
    shown = shown or target
    check_reward_name(target)
    where, _, name = target.rpartition(":")
    module = _load_file(Path(where), shown) if _is_file(where) else _import(where, shown)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"task.reward={shown}: {where} has no {name!r} (its functions: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise ValueError(f"task.reward={shown}: {name} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(f"task.reward={shown}: {name} is async; a reward is a plain function: {SIGNATURE.format(name=name)}")
    try:
        inspect.signature(fn).bind("prompt", "response", "answer", {})
    except TypeError as e:
        raise ValueError(f"task.reward={shown}: {name}{inspect.signature(fn)} cannot be called as "
                         f"{name}(prompt, response, answer, extra) ({e}); define {SIGNATURE.format(name=name)}") from e
    except ValueError:  # no signature to read (a builtin): its first call tells
        pass
    return fn


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _load_file(path: Path, shown: str):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"task.reward={shown}: no file {path} (a relative path is relative to the working directory, "
                         f"{os.getcwd()})")
    # a name of its own per file, registered before it runs, so that its classes pickle and its imports resolve
    name = f"tailspec_reward_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"task.reward={shown}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"task.reward={shown}: loading {path} failed: {type(e).__name__}: {e}") from e
    return module


def _import(where: str, shown: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
            raise ValueError(f"task.reward={shown}: no module named {where!r} (run from the folder that holds it, add "
                             f"that folder to PYTHONPATH, or give the file as path/to/file.py:function)") from e
        raise ValueError(f"task.reward={shown}: importing {where} failed: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ValueError(f"task.reward={shown}: importing {where} failed: {type(e).__name__}: {e}") from e
