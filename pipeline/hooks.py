"""Step hooks: the optional parts of a run, run by the loop around every RL step.

A config turns parts on (bubble drafts, spot training, history drafts, a learning speculation
policy, a drafter that follows the policy's LM head); the run's builder (launch.run.colocated,
launch.run.separated) makes one hook for each part that is on, and the loop (pipeline.trainer's
Trainer; on a separated run's rollout ranks pipeline.separated.rollout) calls every hook at each
moment of the step, in list order, without asking which parts the run has. Every method is a
no-op by default; a hook overrides the moments it acts at. In the order of a step:

    rollout side
    begin(step)                   the step starts, before its rollouts
    requests(step, requests)      a generation round's requests on this rank, before the engine
                                  takes them: a hook attaches what changes no token (drafts,
                                  predicted lengths) and returns them
    rolled_out(step, scored)      a generation round's rollouts on this rank (dynamic sampling:
                                  several rounds a step; the asynchronous mode's include step+1's)
    collect(step, scored)         every rank's rollouts are done (the idle window has closed);
                                  collective on every rank
    update side
    updating(step, version)       separated rollout ranks only: the actor ranks' update runs
                                  elsewhere; a hook may work until actor rank 0 announces the push
                                  of `version` (the Trainer never calls it: its ranks update)
    weights(named)                the actor's weights on their way to the engine, at every sync
    end(step)                     the update is done and its weights are served; collective
    metrics(scored)               the step's metrics, with the step's trained rollouts; may be collective

Metrics over ranks: `reduce` names the keys of `metrics()` that are this rank's own values and
how the step's value is made from every rank's ("mean": over the ranks that report the key;
"sum"); the Trainer reduces them, one gather for every hook's (`reduce_over_ranks`). Any other
key is already the step's: the hook reduced it itself.

Memory: `optional` marks a hook whose work the run can do without (bubble drafts, spot training:
they change no token); `shed()` turns that work off for the rest of the run and frees what it
holds, returning what it turned off (pipeline.memory_guard sheds it before memory runs out).

Checkpoints: `name` is a hook's key in a run checkpoint's components ("" keeps no state):
`state_dict` / `load_state_dict` are its state there, `checkpoint_files` the files it writes
beside it, `drafters()` the drafter networks it trains, saved where the engine holds none.

It knows the hooks' moments only; what a part does in them lives with the part (pipeline.drafts.bubble,
pipeline.drafts.history) or, for parts outside the loop, in the small adapters below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from common.idle import IdleWork, PushFlag
from engine.backend import NamedTensors
from engine.types import Request

if TYPE_CHECKING:
    from engine.spec.policy import SpecPolicy
    from pipeline.rollout.stage import ScoredRollouts

Reduce = Literal["mean", "sum"]


class StepHook:
    name = ""  # its key in a run checkpoint's components; "" keeps no state
    reduce: Mapping[str, Reduce] = {}  # keys of metrics() that are this rank's, and how ranks combine them
    optional = False  # the run can do without its work (shed() turns it off)

    def begin(self, step: int) -> None:
        pass

    def requests(self, step: int, requests: list[Request]) -> list[Request]:
        return requests

    def rolled_out(self, step: int, scored: ScoredRollouts) -> None:
        pass

    def collect(self, step: int, scored: ScoredRollouts) -> None:
        pass

    def updating(self, step: int, version: int) -> None:
        pass

    def weights(self, named: NamedTensors) -> NamedTensors:
        return named

    def end(self, step: int) -> None:
        pass

    def metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """Subfolder name -> a function writing this hook's files into that folder of a checkpoint."""
        return {}

    def drafters(self) -> list[torch.nn.Module]:
        return []

    def shed(self) -> list[str]:
        """Turns this hook's optional work off for the rest of the run; -> what it turned off."""
        return []


def hook_metrics(hooks: Iterable[StepHook], scored: ScoredRollouts,
                 gather: Callable[[list[float]], list[list[float]]]) -> dict[str, float]:
    """Every hook's metrics of the step: the keys a hook declares in `reduce` made from every rank's
    value as it declares (`gather`: this rank's values -> every rank's, by rank; called once, on every
    rank, when any hook declares a key), the others as the hooks gave them."""
    out: dict[str, float] = {}
    mine: dict[str, float] = {}
    how: dict[str, Reduce] = {}
    for hook in hooks:
        m = hook.metrics(scored)
        out.update({k: v for k, v in m.items() if k not in hook.reduce})
        mine.update({k: v for k, v in m.items() if k in hook.reduce})
        how.update(hook.reduce)
    if how:
        out.update(reduce_over_ranks(how, gather([mine.get(k, math.nan) for k in how])))
    return out


def reduce_over_ranks(how: Mapping[str, Reduce], rows: list[list[float]]) -> dict[str, float]:
    """The step's value of each key of `how` from every rank's row (its values in `how`'s order, NaN
    where a rank has none): the mean over the ranks that have it, or their sum; a key no rank has
    is left out."""
    out = {}
    for i, (k, h) in enumerate(how.items()):
        vals = [row[i] for row in rows if not math.isnan(row[i])]
        if vals:
            out[k] = sum(vals) if h == "sum" else sum(vals) / len(vals)
    return out


def load_hook_states(hooks: Iterable[StepHook], components: dict) -> None:
    """A resumed run's state of each hook, from a checkpoint's components (a hook absent there starts fresh)."""
    for hook in hooks:
        if hook.name and hook.name in components:
            hook.load_state_dict(components[hook.name])


class IdleWorkHook(StepHook):
    """The idle window's work (common.idle.IdleWork: bubble pre-generation, spot training) at the
    step's moments; the window itself runs it (common.idle.IdleWindows.run). Its metrics are
    what `settle()` returned after the update (summed over ranks by the work itself)."""

    name = "idle_work"
    optional = True

    def __init__(self, work: IdleWork) -> None:
        self.work = work
        self.settled: dict[str, float] = {}

    def begin(self, step: int) -> None:
        self.work.begin(step)

    def rolled_out(self, step: int, scored: ScoredRollouts) -> None:
        self.work.rollouts_done(step, scored.batch)

    def end(self, step: int) -> None:
        self.settled = self.work.settle()

    def metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        return self.settled

    def state_dict(self) -> dict:
        return self.work.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.work.load_state_dict(state)

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        return self.work.checkpoint_files()

    def drafters(self) -> list[torch.nn.Module]:
        net = self.work.drafter()
        return [] if net is None else [net]

    def shed(self) -> list[str]:
        return self.work.shed()


class UpdateIdleWorkHook(IdleWorkHook):
    """The idle work of a separated run's rollout ranks (spot.separated, spot.pool.separated_follower): also
    through the actor ranks' update, until actor rank 0 announces the push in the job's store
    (common.idle.PushFlag), which ends that window."""

    def __init__(self, work: IdleWork, push_flag: PushFlag) -> None:
        super().__init__(work)
        self.push_flag = push_flag

    def updating(self, step: int, version: int) -> None:
        self.work.through_update(self.push_flag.window(step, version))


class SpecPolicyHook(StepHook):
    """The engine's speculation policy (engine.spec.policy): its metrics every step, and a learning
    policy's state (the tuner's) in checkpoints, so a resumed run continues where it was."""

    name = "spec_policy"

    def __init__(self, policy: SpecPolicy) -> None:
        self.policy = policy

    def metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        return self.policy.metrics()

    def state_dict(self) -> dict:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state)


class WeightsFollower(StepHook):
    """Something that copies weights as they go by on every sync (spot.buffer.actor_features.HeadTarget:
    the out-of-process drafter's embedding and LM head follow the policy's)."""

    def __init__(self, follow: Callable[[NamedTensors], NamedTensors]) -> None:
        self.follow = follow

    def weights(self, named: NamedTensors) -> NamedTensors:
        return self.follow(named)
