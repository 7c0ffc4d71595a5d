"""Where a run's work goes: each rank's role and the process groups of a placement, built once.

Vocabulary: an *actor rank* trains (a data-parallel replica of the actor); a *rollout rank*
holds a rollout engine and generates. `colocated`: every rank is both (one group: the whole
job). `separated` (`pipeline.placement=separated pipeline.actor_ranks=K` under one torchrun):
ranks 0..K-1 are actor ranks, K..W-1 rollout ranks, with three groups besides the job's:

- the *actor group* (ranks 0..K-1): DDP's gradient all-reduce, the loss weights' sums, checkpoints;
- the *rollout group* (ranks K..W-1): the rollout ranks' idle window (the wait for the slowest);
- the *push group* (rank 0 and ranks K..W-1): the weight push (pipeline.separated.weight_sync), a broadcast
  from actor rank 0.

The data path (rollouts to the actor ranks, pipeline.separated.shipment) is point to point between global
ranks over the job's group. New groups take the job's backend (gloo on CPU, `cpu:gloo,cuda:nccl`
on GPU) and its collective timeout, so a dead peer ends every group's wait. Building a placement
is collective: every rank creates every group, in the same order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from pipeline.dist import Ranks

Role = Literal["both", "actor", "rollout"]


@dataclass(frozen=True)
class Placement:
    kind: Literal["colocated", "separated"]
    job: Ranks  # this rank in the whole job
    actor_ranks: tuple[int, ...]  # global ranks that train
    rollout_ranks: tuple[int, ...]  # global ranks that generate
    actors: Ranks | None  # this rank within the actor group (None on a rollout rank)
    rollouts: Ranks | None  # this rank within the rollout group (None on an actor rank)
    push_group: object = None  # actor rank 0 and the rollout ranks (separated only)

    @property
    def role(self) -> Role:
        if self.kind == "colocated":
            return "both"
        return "actor" if self.actors is not None else "rollout"

    @property
    def push_source(self) -> int:
        """The global rank whose weights the rollout ranks load: actor rank 0."""
        return self.actor_ranks[0]

    @property
    def first_rollout(self) -> int:
        """The rollout rank that evaluates and reports the engine's state for checkpoints."""
        return self.rollout_ranks[0]

    @classmethod
    def colocated(cls, job: Ranks) -> Placement:
        every = tuple(range(job.world))
        return cls(kind="colocated", job=job, actor_ranks=every, rollout_ranks=every, actors=job, rollouts=job)


def build_placement(pipeline_cfg, job: Ranks, timeout_s: float = 1800.0) -> Placement:
    """The placement `pipeline_cfg` (pipeline.config.PipelineSection) asks for, on this rank
    (collective in separated mode)."""
    actors, _ = pipeline_cfg.roles(job.world)
    if not pipeline_cfg.separated:
        return Placement.colocated(job)
    actor_ranks, rollout_ranks = tuple(range(actors)), tuple(range(actors, job.world))
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [dist.new_group(list(ranks), timeout=timeout)
              for ranks in (actor_ranks, rollout_ranks, (actor_ranks[0], *rollout_ranks))]

    def within(ranks: tuple[int, ...], group) -> Ranks | None:
        if job.rank not in ranks:
            return None
        return Ranks(rank=ranks.index(job.rank), world=len(ranks), local_rank=job.local_rank, group=group)

    return Placement(kind="separated", job=job, actor_ranks=actor_ranks, rollout_ranks=rollout_ranks,
                     actors=within(actor_ranks, groups[0]), rollouts=within(rollout_ranks, groups[1]),
                     push_group=groups[2])
