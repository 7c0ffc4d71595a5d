"""Spot training on a separated placement's rollout ranks: the drafter trained in all their idle time.

A rollout rank of a separated placement (pipeline.separated.rollout) is idle twice per RL step:
in the *tail window* (its rollouts are done, another rollout rank's are not: common.idle.window)
and in the *update window* (it has sent its rollouts and waits through the actor's update for the
next weight push: common.idle.update). `SeparatedSpotWork` trains the rank's copy of the drafter
in both, on samples of the node's DataBuffer, and stops each when it ends: the tail window when
every rollout rank is done, the update window when actor rank 0 announces its push in the job's
store. Which rank trains in a window is decided by that control plane alone: every rollout rank
trains until it sees the window's end, no rendezvous per window. Each rank sets its state
(common.idle.states) as it goes: GENERATING, IDLE, TRAINING, BARRIER.

One average per step, as the update window ends: the rollout ranks' replicas, each weighted by
the micro-steps it ran in the step's windows (spot.coordinator.post_average, one all-reduce on
the rollout ranks' own process group, posted and not waited for), so the weights every rank
continues from are the same after every step and replicas never diverge. The all-reduce runs
while the rank receives the weight push; `settle()` after it waits, loads the average into the
trainer's copy and into the engine as a new drafter version, before the next rollouts, and
returns the step's metrics over every rollout rank.

Features: the engine's sink stashes each generate call's; a rank puts them as its tail window
opens, except the rank that finished last (common.idle.rules), which puts them as its update
window opens instead: off the step's critical path, in time for the update window's training.

Time: `spot/idle_s` is the rollout ranks' idle seconds (both windows), `spot/train_s` the
training within them (`spot/utilisation` = train_s / idle_s), `spot/overrun_s` the training past
a window's end (the step pays it: it delays the shipment or the push); `spot/update_*` are the
update window's share. The update window's end is actor rank 0's clock at the announcement
(time.time: one clock per node; across nodes, their clocks' offset errs the split).

This module knows the loop only through common.idle: pipeline imports none of it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from common.idle import ControlPlane, IdleWindow, IdleWork, RankState, UpdateWindow
from engine.backend import RolloutBackend
from engine.spec.eagle import EagleModel
from spot.buffer.ring import DataBuffer
from spot.colocated import SpotRun, drafter_copy, node_buffer, spot_trainer
from spot.config import SpotConfig
from spot.coordinator import FilledTime, PendingAverage, ServedDrafterState, SpotSettings, post_average
from spot.buffer.segment import node_name, segment_name
from spot.buffer.sink import DataBufferSink, put_as_window_opens
from spot.training.trainer import SpotTrainer

# Per rank and step, summed over the step's windows; gathered with the average.
STATS = ("micro_steps", "train_s", "idle_s", "loss_sum", "top1_sum", "aborted", "dropped_s", "overrun_s",
         "update_micro_steps", "update_train_s", "update_idle_s")
_AT = {k: i for i, k in enumerate(STATS)}


class SeparatedSpotWork(ServedDrafterState, IdleWork):
    """Spot training on one rollout rank of a separated placement (common.idle.IdleWork)."""

    name = "spot"

    def __init__(self, engine: RolloutBackend, trainer: SpotTrainer, buffer: DataBuffer, sink: DataBufferSink,
                 control: ControlPlane, settings: SpotSettings, group=None) -> None:
        self.engine, self.trainer, self.buffer, self.sink = engine, trainer, buffer, sink
        self.control, self.settings, self.group = control, settings, group
        self.mine = [0.0] * len(STATS)  # this rank's statistics of the step so far
        self.pending: PendingAverage | None = None  # the step's average, posted, not yet settled
        self.drafter_version = 0
        self.generator = torch.Generator().manual_seed(settings.seed * 1000 + control.rank)

    # checkpoints (ServedDrafterState): the first rollout rank writes them into the run's, every
    # rollout rank resumes from them

    def _state(self, step: int, state: RankState) -> None:
        self.control.set(step, state)

    def begin(self, step: int) -> None:
        self._state(step, RankState.GENERATING)

    def rollouts_done(self, step: int, batch) -> None:
        self.sink.stash(batch.rollouts, step)

    def _rows(self, step: int):
        s = self.settings
        return [e.to_row() for e in self.buffer.sample(s.rows_per_step, step=step - self.sink.lag,
                                                       offset_ratio=s.offset_ratio, generator=self.generator)]

    def _train(self, step: int, stop, clock) -> tuple[dict[str, float], float, float]:
        """Micro-steps until `stop()` (or the step's budget); -> (the trainer's result, t0, t1)."""
        left = self.settings.max_micro_steps
        if left is not None:
            left -= int(self.mine[_AT["micro_steps"]])
        t0 = clock()
        result = self.trainer.train(lambda i: self._rows(step), stop, left, keep_cut=True) if left != 0 else {}
        return result, t0, clock()

    def _add(self, result: dict[str, float], filled: FilledTime, update: bool) -> None:
        n = result.get("spot/micro_steps", 0.0)
        add = {"micro_steps": n, "train_s": filled.useful_s, "idle_s": filled.idle_s,
               "loss_sum": result.get("spot/drafter_loss", 0.0) * n, "top1_sum": result.get("spot/top1", 0.0) * n,
               "aborted": result.get("spot/aborted", 0.0), "dropped_s": result.get("spot/dropped_s", 0.0),
               "overrun_s": filled.overrun_s}
        if update:
            add |= {"update_micro_steps": n, "update_train_s": filled.useful_s, "update_idle_s": filled.idle_s}
        for k, v in add.items():
            self.mine[_AT[k]] += v

    def work(self, window: IdleWindow) -> dict[str, float]:
        """The tail window: trains until every rollout rank is done, then waits for the last one."""
        self._state(window.step, RankState.IDLE)
        put_as_window_opens(self.sink, window)
        self.trainer.model.refresh_head()  # the target's LM head changed at the last weight push
        self._state(window.step, RankState.TRAINING)
        result, t0, t1 = self._train(window.step, window.others_done, window.clock)
        self._add(result, FilledTime.of(t0, t1, window.started, window.all_done_at()), update=False)
        self._state(window.step, RankState.BARRIER)
        return self.buffer.stats()

    def through_update(self, window: UpdateWindow) -> None:
        """The update window: trains until the push is announced, then posts the step's average."""
        self.sink.put_stashed()  # what the last rank held back in its tail window
        self._state(window.step, RankState.TRAINING)
        result, t0, t1 = self._train(window.step, window.pushed, window.clock)
        self._add(result, FilledTime.of(t0, t1, window.started, window.pushed_at()), update=True)
        self._state(window.step, RankState.BARRIER)
        mine, self.mine = self.mine, [0.0] * len(STATS)
        self.pending = post_average(list(self.trainer.model.named_parameters()), mine[_AT["micro_steps"]], mine,
                                    self.group, k=len(STATS))

    def settle(self) -> dict[str, float]:
        """After the weight push: the step's average into the trainer and the engine (a new
        drafter version when any rank trained); -> the step's metrics over every rollout rank."""
        assert self.pending is not None, "settle() without an update window: SeparatedRollout calls both every step"
        averaged, every = self.pending.result()  # [rollout ranks, len(STATS)]
        self.pending = None
        sums = every.sum(0)
        total = {k: float(sums[i]) for k, i in _AT.items()}
        metrics = {"spot/micro_steps": total["micro_steps"], "spot/train_s": total["train_s"],
                   "spot/idle_s": total["idle_s"], "spot/overrun_s": float(every[:, _AT["overrun_s"]].max()),
                   "spot/aborted": total["aborted"], "spot/dropped_s": total["dropped_s"],
                   "spot/update_micro_steps": total["update_micro_steps"], "spot/update_train_s": total["update_train_s"],
                   "spot/update_idle_s": total["update_idle_s"]}
        if total["idle_s"] > 0:
            metrics["spot/utilisation"] = total["train_s"] / total["idle_s"]
        if total["update_idle_s"] > 0:
            metrics["spot/update_utilisation"] = total["update_train_s"] / total["update_idle_s"]
        if averaged is not None:
            self.trainer.load_weights(averaged)
            self.drafter_version += 1
            self.engine.load_drafter_weights(averaged, version=self.drafter_version)
            metrics["spot/drafter_loss"] = total["loss_sum"] / total["micro_steps"]
            metrics["spot/top1"] = total["top1_sum"] / total["micro_steps"]
        metrics["spot/drafter_version"] = float(self.drafter_version)
        return metrics | self.buffer.stats()


def eagle_net(engine: RolloutBackend) -> EagleModel:
    """The engine's one EAGLE drafter network, which spot training needs (ValueError naming the keys otherwise)."""
    nets = engine.drafter_nets()
    if len(nets) != 1 or not isinstance(nets[0], EagleModel):
        raise ValueError("spot.enabled needs a speculative engine with one EAGLE drafter (engine.spec.enabled: true, "
                         "engine.spec.drafter: eagle or eagle3, engine.spec.drafter_path: a warm-started drafter)")
    return nets[0]


def node_slot(group) -> tuple[int, int]:
    """(this rank's index among the group's ranks on its node, how many the node has), by node name
    (spot.buffer.segment.node_name; collective over `group`)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hosts = [None] * world
    dist.all_gather_object(hosts, node_name(), group=group)
    mine = [g for g in range(world) if hosts[g] == hosts[rank]]
    return mine.index(rank), len(mine)


def build_separated_spot(cfg: SpotConfig, engine: RolloutBackend, *, run_name: str, group, store, seed: int,
                         max_new_tokens: int, resume: Path | None = None) -> SpotRun:
    """This rollout rank's spot training (collective over `group`: the rollout ranks' own process
    group, which also carries the averages). The node's buffer is created by the node's first
    rollout rank (found by node name over the group) and attached by the others. `resume`: a
    checkpoint folder whose `spot/` the trainer continues from (the work's own state is loaded by
    the caller)."""
    net = eagle_net(engine)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    owner = node_slot(group)[0] == 0
    buffer = node_buffer(cfg, net, segment_name(run_name), owner, lambda: dist.barrier(group=group))
    sink = DataBufferSink(buffer, max_new_tokens=max_new_tokens, feature_layers=net.config.aux_layers)
    engine.sink = sink
    trainer = spot_trainer(cfg, drafter_copy(net), seed * 1000 + rank, resume)
    settings = SpotSettings(rows_per_step=cfg.rows_per_step, offset_ratio=cfg.offset_ratio,
                            max_micro_steps=cfg.max_micro_steps, seed=seed)
    work = SeparatedSpotWork(engine, trainer, buffer, sink, ControlPlane(store, rank, world), settings, group)
    return SpotRun(work=work, engine=engine, buffer=buffer, owner=owner, group=group)
