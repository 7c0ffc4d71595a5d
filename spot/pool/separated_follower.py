"""Rollout ranks of a separated run whose drafter an elastic spot pool trains (`spot.mode: pool`).

The pool (spot.pool.elastic, launched by launch.spot_pool) is another torchrun job whose members live on
the rollout ranks' nodes: membership changes go through its own torchrun-elastic rendezvous. This
module is the run's side of it, one `SeparatedPoolFollower` per rollout rank:

- it fills the node's DataBuffer (named `spot.buffer_name`, so members attach to it) with the
  features its engine's sink captured, as a colocated follower does (spot.pool.follower): as its tail
  window opens, or in the update window on the rank that finished last (common.idle.rules);
- it tells the node's members when they may train, through the buffer's gate (spot.buffer.gate): IDLE
  as its tail window opens (through the actor's update too), GENERATING once the weight push is
  in (the next generation, or an evaluation, follows), no state once the run has closed. A member
  trains while every rollout rank of its node is idle, so participation per window is decided by
  the gate alone, with no rendezvous;
- once per step, in the update window (the engine is idle, waiting for the push), the rollout
  ranks load the pool's newest publication (`<spot.pool_dir>/published/LATEST`) as a new drafter
  version, all the same one: the first rollout rank reads LATEST and broadcasts the version on
  the rollout ranks' group; each rank reads that version's weights; they load them only when
  every rank could (one all-reduce), so a publication the pool pruned in between is loaded by
  none and tried again at the next step;
- after the push (`settle`) it reports the step's figures over every rollout rank (one
  all-reduce): `spot/drafter_version` served, `spot/drafter_micro_steps` (the pool's micro-steps
  in that version), and from the gates' counters, per node (read by the node's first rollout
  rank, summed over nodes): `spot/idle_s` (seconds in which every rollout rank of the node was
  idle), `spot/train_s` and `spot/overrun_s` (seconds of the members' micro-steps within and past
  those spans), `spot/micro_steps` (micro-steps the members trained on their own rows) and
  `spot/utilisation` = train_s / idle_s.

What the run cannot know of the pool: the figures count what members added to the gate, so a
micro-step in flight at the read counts at the next step, one whose member was killed never
counts, and a pool that is down (restarting after a lost member, not started) shows as idle time
not trained; with more than one member per node (not the supported layout) their seconds add up,
so utilisation can exceed 1; the pool's loss is in its own log, not here. A resumed run serves
its warm drafter (version 0) until the first step's update window loads the pool's newest.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from common.idle import IdleWindow, IdleWork, RankState, UpdateWindow
from engine.backend import RolloutBackend
from spot.buffer.ring import DataBuffer
from spot.colocated import SpotRun, node_buffer
from spot.config import SpotConfig
from spot.buffer.gate import GateCounters, NodeGate
from spot.pool.elastic import latest_published, published_weights
from spot.buffer.segment import segment_name
from spot.separated import eagle_net, node_slot
from spot.buffer.sink import DataBufferSink, put_as_window_opens

COUNTERS = tuple(f.name for f in dataclasses.fields(GateCounters))  # a node's, summed over nodes


class SeparatedPoolFollower(IdleWork):
    """One rollout rank's side of the elastic pool (common.idle.IdleWork; the module docstring says what it does)."""

    name = "spot"

    def __init__(self, engine: RolloutBackend, buffer: DataBuffer, sink: DataBufferSink, gate: NodeGate, slot: int,
                 pool_dir: str, group=None) -> None:
        self.engine, self.buffer, self.sink, self.gate, self.slot = engine, buffer, sink, gate, slot
        self.pool_dir, self.group = Path(pool_dir), group
        self.reporter = slot == 0  # the node's first rollout rank reports the node's gate counters
        self.seen = gate.counters() if self.reporter else None
        self.step = 0
        self.drafter_version, self.drafter_micro_steps = 0, 0

    def _state(self, state: RankState | None) -> None:
        self.gate.set(self.slot, self.step, state)

    def begin(self, step: int) -> None:
        self.step = step
        self._state(RankState.GENERATING)

    def rollouts_done(self, step: int, batch) -> None:
        self.sink.stash(batch.rollouts, step)

    def work(self, window: IdleWindow) -> dict[str, float]:
        """The tail window: the node's members may train from now; the features go in (common.idle.rules)."""
        self.step = window.step
        self._state(RankState.IDLE)
        put_as_window_opens(self.sink, window)
        return self.buffer.stats()

    def through_update(self, window: UpdateWindow) -> None:
        """The update window: the held features go in, then the pool's newest drafter is loaded."""
        self._state(RankState.IDLE)
        self.sink.put_stashed()
        self.follow()

    def follow(self) -> None:
        """Loads the pool's newest publication on every rollout rank, or on none (collective on the group)."""
        version = torch.tensor([0], dtype=torch.int64)
        if dist.get_rank(self.group) == 0:
            latest = latest_published(self.pool_dir)
            version[0] = latest[0] if latest else 0
        dist.broadcast(version, group=self.group, group_src=0)
        v = int(version)
        if v <= self.drafter_version:
            return
        folder = self.pool_dir / "published" / f"v{v}"
        try:
            weights = published_weights(folder)
            micro_steps = int(json.loads((folder / "config.json").read_text()).get("spot_micro_steps", 0))
        except FileNotFoundError:  # pruned since LATEST named it: no rank loads it (below); the next step tries anew
            weights = None
        every = torch.tensor([int(weights is not None)], dtype=torch.int64)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.group)
        if int(every):
            self.engine.load_drafter_weights(weights, version=v)
            self.drafter_version, self.drafter_micro_steps = v, micro_steps

    def settle(self) -> dict[str, float]:
        """After the push: the node's members stop at their next micro-step boundary; the step's figures."""
        self._state(RankState.GENERATING)
        mine = torch.zeros(len(COUNTERS), dtype=torch.float64)
        if self.reporter:
            now = self.gate.counters()
            delta, self.seen = now - self.seen, now
            mine = torch.tensor(dataclasses.astuple(delta), dtype=torch.float64)
        dist.all_reduce(mine, group=self.group)
        nodes = dict(zip(COUNTERS, mine.tolist(), strict=True))
        metrics = {f"spot/{k}": v for k, v in nodes.items()}
        if nodes["idle_s"] > 0:
            metrics["spot/utilisation"] = nodes["train_s"] / nodes["idle_s"]
        metrics |= {"spot/drafter_version": float(self.drafter_version),
                    "spot/drafter_micro_steps": float(self.drafter_micro_steps)}
        return metrics | self.buffer.stats()

    def close(self) -> None:
        """The run has ended on this rank: its gate slot holds no state, so the node's members wait."""
        self._state(None)


def build_separated_pool(cfg: SpotConfig, engine: RolloutBackend, *, run_name: str, group,
                         max_new_tokens: int) -> SpotRun:
    """This rollout rank's follower of an elastic pool (collective over `group`: the rollout ranks'
    own process group). The node's buffer is created by the node's first rollout rank, gated by
    the node's rollout ranks (found by host name over the group), and attached by the others."""
    net = eagle_net(engine)
    slot, node_ranks = node_slot(group)
    owner = slot == 0
    buffer = node_buffer(cfg, net, segment_name(run_name), owner, lambda: dist.barrier(group=group),
                         gate_ranks=node_ranks)
    sink = DataBufferSink(buffer, max_new_tokens=max_new_tokens, feature_layers=net.config.aux_layers)
    engine.sink = sink
    work = SeparatedPoolFollower(engine, buffer, sink, NodeGate(buffer), slot, cfg.pool_dir, group)
    return SpotRun(work=work, engine=engine, buffer=buffer, owner=owner, group=group, before_close=work.close)

