"""A user's reward function, written in verl's, TRL's or TailSpec's convention, called as TailSpec's.

The run calls every reward once per rollout as `fn(prompt, response, answer, extra)`
(pipeline.tasks.reward_plugins). A plug-in may instead be written the way verl or TRL call
theirs; `convention_of` tells the three apart by the *names* of the function's parameters (never
by trying a call), and `Adapter` calls it in its own convention:

- **verl** (`verl.utils.reward_score`): `compute_score(data_source, solution_str, ground_truth,
  extra_info=None) -> float | dict`, recognised by `solution_str` and `ground_truth`. Called with
  keywords, as verl's reward manager calls it: `data_source` is the row's `data_source` field
  (verl's parquet has one; "" without), `solution_str` the response, `ground_truth` the answer,
  `extra_info` the row's `extra_info` field when it has one, else the row's other fields. A
  keyword the function does not take (and no `**kwargs`) is left out, so `compute_score(
  solution_str, ground_truth)` works too. A dict result keeps verl's meaning: `score` and metrics.
- **TRL** (`GRPOTrainer(reward_funcs=...)`): `reward_func(prompts, completions, **kwargs) ->
  list[float | None]`, recognised by `completions`. Batched in TRL; called here on one-row batches,
  so that every rollout keeps its own deadline and failure count in the reward pool. `kwargs` hold
  the row's other fields as one-item lists (TRL passes a dataset's columns so) and the answer under
  `answer` and under task.answer_field's name. In a chat run (task.chat) the prompt and completion
  are conversational, as TRL gives them for a conversational dataset: `[{"role": "user", "content":
  prompt}]` and `[{"role": "assistant", "content": response}]`; otherwise strings. `None` means
  "this function does not score this row" (TRL's multi-task convention): a weighted list of
  rewards leaves it out of the sum (pipeline.tasks.reward_plugins.WeightedReward); alone, it is a
  failure.
- **TailSpec**: `fn(prompt, response, answer, extra)`, any function that binds those four
  positionally and is neither of the above.

This module knows nothing of where rewards run or how their results are checked
(pipeline.tasks.reward_scoring); it only translates one call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

Convention = Literal["tailspec", "verl", "trl"]

SIGNATURES = {
    "tailspec": "def {name}(prompt, response, answer, extra) -> float | dict",
    "verl": "def {name}(data_source, solution_str, ground_truth, extra_info=None) -> float | dict",
    "trl": "def {name}(prompts, completions, **kwargs) -> list[float]",
}
_VERL_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _accepted(fn: Callable[..., Any], names: Sequence[str]) -> tuple[str, ...]:
    """The keywords of `names` that `fn` takes (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return tuple(names)
    return tuple(n for n in names if n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY)


def convention_of(fn: Callable[..., Any], name: str) -> Convention:
    """Which convention `fn` is written in, from its parameters' names; ValueError (a message ending
    in the three signatures) when it fits none."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # no signature to read (a builtin): only TailSpec's positional call can be tried
        return "tailspec"
    expected = "; or ".join(s.format(name=name) for s in SIGNATURES.values())
    if "solution_str" in params and "ground_truth" in params:
        try:
            inspect.signature(fn).bind(**{k: None for k in _accepted(fn, _VERL_KEYS)})
        except TypeError as e:
            raise ValueError(f"{name}{inspect.signature(fn)} looks like verl's compute_score but cannot be called as "
                             f"verl calls it ({e}); expected {expected}") from e
        return "verl"
    if "completions" in params:  # its other parameters name data columns, which only its calls can bring
        if params["completions"].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(f"{name}{inspect.signature(fn)} looks like a TRL reward function, but TRL passes "
                             f"completions by keyword; expected {expected}")
        return "trl"
    try:
        inspect.signature(fn).bind("prompt", "response", "answer", {})
    except TypeError as e:
        raise ValueError(f"{name}{inspect.signature(fn)} fits no reward convention ({e}); expected {expected}") from e
    return "tailspec"


class Adapter:
    """`fn` (written in `convention`) called as `(prompt, response, answer, extra)`.

    `answer_key`: the data's answer field, under whose name a TRL function also gets the answer;
    `chat`: whether a TRL function gets conversational prompts and completions."""

    def __init__(self, fn: Callable[..., Any], convention: Convention, *, answer_key: str = "answer",
                 chat: bool = False) -> None:
        self.fn, self.convention, self.answer_key, self.chat = fn, convention, answer_key, chat
        params = inspect.signature(fn).parameters if convention != "tailspec" else {}
        self._any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._names = set(params)

    def _takes(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keywords of `kwargs` the function takes (all of them when it takes **kwargs)."""
        return kwargs if self._any_keyword else {k: v for k, v in kwargs.items() if k in self._names}

    def __call__(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> Any:
        if self.convention == "verl":
            return self.fn(**self._takes({"data_source": extra.get("data_source", ""), "solution_str": response,
                                          "ground_truth": answer, "extra_info": extra.get("extra_info", dict(extra))}))
        if self.convention == "trl":
            return self._trl(prompt, response, answer, extra)
        return self.fn(prompt, response, answer, extra)

    def _trl(self, prompt: str, response: str, answer: str, extra: Mapping[str, Any]) -> float | None:
        if self.chat:
            prompts: list[Any] = [[{"role": "user", "content": prompt}]]
            completions: list[Any] = [[{"role": "assistant", "content": response}]]
        else:
            prompts, completions = [prompt], [response]
        kwargs = {k: [v] for k, v in extra.items()}
        kwargs.setdefault("answer", [answer])
        kwargs.setdefault(self.answer_key, [answer])
        kwargs.update(prompts=prompts, completions=completions)
        scores = self.fn(**self._takes(kwargs))
        if not isinstance(scores, Sequence) or isinstance(scores, (str, bytes)) or len(scores) != 1:
            raise ValueError(f"a TRL reward function returns a list with one score per completion; for one completion it "
                             f"returned {scores!r:.120}")
        return scores[0]
