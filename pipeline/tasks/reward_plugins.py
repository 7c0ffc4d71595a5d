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

`task.reward` names the training reward, one of:

- null: the task's own, `Task.reward(response, answer)` (arith and mult: the `#### N` line; math:
  math-verify);
- `math_verify`, or with options `math_verify(format_weight=0.2, timeout_s=5)`:
  `MathVerifyReward` (pipeline.tasks.rewards), `format_weight` its bonus for a `\\boxed{}` answer;
- `exact`: `ExactAnswerReward`, the final answer compared as a string;
- `path/to/file.py:function`: a function in a Python file (a relative path is relative to the
  working directory);
- `package.module:function`: a function in an importable module;
- a list of the above, summed with `task.reward_weights` (all 1 by default), as TRL's
  `reward_funcs` with `reward_weights`: `WeightedReward`.

A plug-in may be written in verl's (`compute_score(data_source, solution_str, ground_truth,
extra_info=None)`), TRL's (`reward_func(prompts, completions, **kwargs) -> list[float]`) or
TailSpec's convention, told apart by its parameters' names (pipeline.tasks.reward_signatures).

The held-out reward is the training one without the format bonus: the task's own for null, the
plain `MathVerifyReward()` for math_verify, the same function for exact and plug-ins (held-out
accuracy is then the mean of the plug-in's `score`), and a list's entries' held-out rewards with the
same weights.

A plug-in is loaded here, at construction, so that a missing file, a missing function or a
signature of no convention is a ValueError naming `task.reward` before any rollout; it is pickled
by its name, not its code, and loaded again in each reward worker (pipeline.tasks.reward_pool): a
file's module-level code runs once in every process that loads it. This module does not know
where rewards run (pipeline.tasks.reward_scoring decides).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.tasks.reward_signatures import Adapter, convention_of
from pipeline.tasks.rewards import ExactAnswerReward, MathVerifyReward, Reward

FORMS = ("null, math_verify, math_verify(format_weight=W), exact, <file.py>:<function>, <module>:<function>, or a "
         "list of them")
BUILTIN_OPTIONS = {"math_verify": {"format_weight": float, "timeout_s": int}, "exact": {}}
_BUILTIN = re.compile(r"^(?P<name>[a-z_]+)\s*(?:\((?P<options>.*)\))?$")


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
    again wherever it is unpickled, called in its own convention (pipeline.tasks.reward_signatures).
    `answer_key` and `chat` shape a TRL function's call (the data's answer field; a chat run)."""

    bounds = None

    def __init__(self, source: str, *, answer_key: str = "answer", chat: bool = False) -> None:
        self.name, self.answer_key, self.chat = source, answer_key, chat
        where, _, function = source.rpartition(":")
        # a file's path is fixed against this working directory now, for workers that might run elsewhere
        self._target = f"{Path(where).resolve()}:{function}" if _is_file(where) else source
        self._load()

    @property
    def convention(self) -> str:
        return self._fn.convention

    def _load(self) -> None:
        fn = load_plugin(self._target, shown=self.name)
        self._fn = Adapter(fn, convention_of(fn, self.name.rpartition(":")[2]) if _has_signature(fn) else "tailspec",
                           answer_key=self.answer_key, chat=self.chat)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "target": self._target, "answer_key": self.answer_key, "chat": self.chat}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self._target = state["name"], state["target"]
        self.answer_key, self.chat = state["answer_key"], state["chat"]
        self._load()

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> Any:
        return self._fn(prompt, response, answer, extra)


class WeightedReward:
    """Several rewards as one: the score is the weighted sum of theirs (TRL's `reward_weights`), and
    each one's own score is a metric `reward/<its function's name>`. A reward that returns None for a
    row (TRL's "not mine") adds nothing to that row's sum; a row no reward scores is an error."""

    bounds = None

    def __init__(self, parts: Sequence[RewardFunction], weights: Sequence[float]) -> None:
        if len(parts) != len(weights):
            raise ValueError(f"task.reward_weights has {len(weights)} weights for {len(parts)} rewards: give one per "
                             "reward, in task.reward's order")
        self.parts, self.weights = list(parts), [float(w) for w in weights]
        self.keys = _metric_keys([p.name for p in self.parts])
        self.name = " + ".join(f"{w:g} x {p.name}" for p, w in zip(self.parts, self.weights))

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> dict[str, float]:
        total, metrics, scored = 0.0, {}, False
        for part, weight, key in zip(self.parts, self.weights, self.keys):
            value = part(prompt, response, answer, extra)
            score = value.get("score") if isinstance(value, Mapping) else value
            if score is None:
                continue
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise ValueError(f"{part.name} returned {score!r}, not a finite number")
            scored = True
            total += weight * score
            metrics[key] = float(score)
        if not scored:
            raise ValueError(f"no reward of {self.name} scored this row (each returned None)")
        return {"score": total, **metrics}


def _metric_keys(names: list[str]) -> list[str]:
    """Each reward's metric key: its function's name (a built-in's own name), made unique."""
    keys = []
    for name in names:
        key = name.rpartition(":")[2] or name
        key = re.sub(r"\W", "_", key.split("(")[0])
        if key in ("score", "mean", "std", "errors", "timeouts"):
            key = f"{key}_reward"
        while key in keys:
            key += "_"
        keys.append(key)
    return keys


def reward_functions(task_cfg, task) -> tuple[RewardFunction, RewardFunction]:
    """(the training reward, the held-out reward) that `task_cfg.reward` names (task_cfg: the run's
    TaskSection; task: a pipeline.tasks.Task). ValueError naming `task.reward` for one that does
    not load."""
    choice = task_cfg.reward
    if choice is None:
        own = TaskReward(task.reward, f"the {task.name} task's reward")
        return own, own
    entries = [choice] if isinstance(choice, str) else list(choice)
    answer_key = task_cfg.answer_field if "." not in task_cfg.answer_field else "answer"
    pairs = [_reward_pair(entry, answer_key, task_cfg.chat) for entry in entries]
    if isinstance(choice, str) and task_cfg.reward_weights is None:
        return pairs[0]
    weights = task_cfg.reward_weights or [1.0] * len(pairs)
    train = WeightedReward([t for t, _ in pairs], weights)
    if all(t is h for t, h in pairs):
        return train, train
    return train, WeightedReward([h for _, h in pairs], weights)


def _reward_pair(entry: str, answer_key: str, chat: bool) -> tuple[RewardFunction, RewardFunction]:
    builtin = builtin_options(entry)
    if builtin is None:
        plugin = PluginReward(entry, answer_key=answer_key, chat=chat)
        return plugin, plugin
    name, options = builtin
    if name == "math_verify":
        held_out = {k: v for k, v in options.items() if k != "format_weight"}
        return BuiltinReward(MathVerifyReward(**options)), BuiltinReward(MathVerifyReward(**held_out))
    exact = BuiltinReward(ExactAnswerReward())
    return exact, exact


def builtin_options(entry: str) -> tuple[str, dict[str, Any]] | None:
    """(name, options) of a built-in reward written `name` or `name(key=value, ...)`; None for a
    plug-in (`...:function`); ValueError naming `task.reward` for an unknown name or option."""
    if ":" in entry:
        return None
    m = _BUILTIN.match(entry.strip())
    if m is None or m["name"] not in BUILTIN_OPTIONS:
        raise ValueError(f"task.reward={entry!r}: expected {FORMS}")
    name, known, options = m["name"], BUILTIN_OPTIONS[m["name"]], {}
    for item in filter(None, (x.strip() for x in (m["options"] or "").split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            allowed = ", ".join(known) or "none"
            raise ValueError(f"task.reward={entry!r}: {item!r} is not an option of {name} (its options: {allowed}; "
                             f"written {name}(key=value, ...))")
        try:
            value = known[key](raw.strip())
        except ValueError:
            raise ValueError(f"task.reward={entry!r}: {name}'s {key} must be a {known[key].__name__}, got "
                             f"{raw.strip()!r}") from None
        if not (math.isfinite(value) and value >= (1 if key == "timeout_s" else 0)):
            raise ValueError(f"task.reward={entry!r}: {key} must be {'>= 1' if key == 'timeout_s' else '>= 0'}, got "
                             f"{value}")
        options[key] = value
    return name, options


def uses_math_verify(task_cfg) -> bool:
    """Whether math-verify scores the training rewards (so data rows need answers it can read)."""
    choice = task_cfg.reward
    if choice is None:
        return task_cfg.name == "math"
    entries = [choice] if isinstance(choice, str) else choice
    return any((builtin_options(e) or ("",))[0] == "math_verify" for e in entries)


def math_verify_format_weight(task_cfg) -> float:
    """The boxed-answer bonus of the run's math_verify reward (0 without one)."""
    choice = task_cfg.reward
    entries = [] if choice is None else [choice] if isinstance(choice, str) else choice
    for entry in entries:
        builtin = builtin_options(entry)
        if builtin is not None and builtin[0] == "math_verify":
            return float(builtin[1].get("format_weight", 0.0))
    return 0.0


def check_reward_name(choice: str | list[str] | None, weights: list[float] | None = None) -> None:
    """ValueError naming `task.reward` / `task.reward_weights` when `choice` has none of the forms it
    can take or the weights do not fit it (the config's check; loading comes at build)."""
    if choice is None:
        if weights is not None:
            raise ValueError("task.reward_weights weigh the rewards of a task.reward list; task.reward is null")
        return
    entries = [choice] if isinstance(choice, str) else choice
    if not entries:
        raise ValueError(f"task.reward is an empty list: name at least one reward ({FORMS})")
    for entry in entries:
        if builtin_options(entry) is not None:
            continue
        where, sep, function = entry.rpartition(":")
        if not (sep and where and function.isidentifier()):
            raise ValueError(f"task.reward={entry!r}: expected {FORMS}")
    if weights is not None:
        if len(weights) != len(entries):
            raise ValueError(f"task.reward_weights has {len(weights)} weights for {len(entries)} rewards in task.reward: "
                             "give one per reward, in the same order")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"task.reward_weights must be finite numbers, got {weights}")


def load_plugin(target: str, shown: str | None = None) -> Callable[..., Any]:
    """The function `target` (`<file.py>:<function>` or `<module>:<function>`) names; ValueError
    naming `task.reward` (as `shown`) if it cannot be loaded or fits no reward convention."""
    shown = shown or target
    where, _, name = target.rpartition(":")
    if not (where and name.isidentifier()):
        raise ValueError(f"task.reward={shown!r}: expected {FORMS}")
    module = _load_file(Path(where), shown) if _is_file(where) else _import(where, shown)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"task.reward={shown}: {where} has no {name!r} (its functions: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise ValueError(f"task.reward={shown}: {name} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(f"task.reward={shown}: {name} is async; a reward is a plain function")
    if _has_signature(fn):
        try:
            convention_of(fn, name)
        except ValueError as e:
            raise ValueError(f"task.reward={shown}: {e}") from None
    return fn


def _has_signature(fn: Callable[..., Any]) -> bool:
    """Whether `fn`'s parameters can be read (a builtin's often cannot: its first call tells)."""
    try:
        inspect.signature(fn)
    except ValueError:
        return False
    return True


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
