"""The actor ranks' loop of a separated placement (pipeline.placement): receive, train, push.

One step on actor rank k (of K), step t counted from 0:

    rollouts of step t from every rollout rank (pipeline.separated.shipment: exactly the groups colocated
    rank k would have generated and trained, `shard_shares(P, K)[k]`, in global order)
    -> the update (pipeline.update.learner, DDP over the actor group: the colocated run's update, bit for
       bit, when K equals the colocated run's world size)
    -> [trainer.async_steps=1: step t+1's rollouts, made meanwhile with the policy before this update]
    -> the weight push of version t+1 from actor rank 0 (pipeline.separated.weight_sync; timing/sync),
       announced in the job's store just before it starts when the rollout ranks have idle work
       that runs until then (common.idle.update)
    -> each rollout rank's wait for it (its idle time through the update) back to actor rank 0,
       with the first rollout rank's idle-work metrics of the step (spot/*, buffer/*).

The rollout ranks run the mirror image (pipeline.separated.rollout); the two keep the same order
of transfers, so no send waits on a receive that comes later. Metrics are actor rank 0's, with the
rollout ranks' reports: `timing/rollout/rank{g}` and `timing/idle/rank{g}` per rollout rank g
(idle: the wait for the slowest rollout rank plus the wait through the actor's update, whose part
is `timing/update_idle/rank{g}`), `timing/receive` (the actor waiting for rollouts),
`timing/logprob`, `timing/update`, `timing/sync`. Held-out accuracy comes from the first rollout
rank; checkpoints are the actor group's, with that rank's step hooks' state as their components.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch.distributed as dist

from common.idle import PushFlag
from pipeline.config import TrainerSection
from pipeline.data import PromptLoader
from pipeline.dist import gather_floats, transfer
from pipeline.update.learner import Learner
from pipeline.separated.placement import Placement
from pipeline.rollout.stage import ScoredRollouts
from pipeline.checkpoint.state import RunState, checkpoint_dir, save_run
from pipeline.shares import shard_shares
from pipeline.separated.shipment import receive_shipments, unpack
from pipeline.rollout.report import RolloutReport, rollout_metrics
from pipeline.trainer import StepResult
from pipeline.separated.weight_sync import push_weights

Received = tuple[ScoredRollouts, dict[int, RolloutReport], float]  # rollouts, reports by rollout rank, seconds waited


class SeparatedActor:
    def __init__(self, trainer_cfg: TrainerSection, n: int, placement: Placement, learner: Learner, loader: PromptLoader,
                 run_dir: Path, start_step: int, push_flag: PushFlag | None = None) -> None:
        """`n`: samples per prompt (rollout.n); `learner`: the update, whose actor is trained and pushed."""
        assert placement.role == "actor" and placement.actors is not None
        self.tc, self.n, self.p, self.r = trainer_cfg, n, placement, placement.actors
        self.learner, self.actor = learner, learner.actor
        self.loader, self.run_dir, self.step_index = loader, Path(run_dir), start_step
        self.share = shard_shares(trainer_cfg.prompts_per_step, self.r.world)[self.r.rank]
        self.pending: Received | None = None  # async mode: the next step's rollouts, received before this push
        self.push_flag = push_flag if self.r.main else None  # announces each push (rollout ranks' idle work)

    def push(self, version: int) -> dict[str, float]:
        """The actor's weights to every rollout rank as `version` (actor rank 0 sends; the others' DDP
        replicas are the same weights)."""
        if not self.r.main:
            return {}
        if self.push_flag is not None:
            self.push_flag.announce(version)
        with transfer(f"pushing policy version {version} to the rollout ranks"):
            return push_weights(self.actor.named_weights(), version, src=self.p.push_source, group=self.p.push_group)

    def _receive(self, step: int) -> Received:
        t = time.perf_counter()
        with transfer(f"receiving step {step + 1}'s rollouts from the rollout ranks"):
            shipments = receive_shipments(self.p.rollout_ranks)
        scored = unpack(shipments, self.share, step, self.n)
        mine = self.loader.next_step()  # this rank's shard of the step: the loader stays where the run is
        if [p.id for p in mine] != [p.id for p in scored.problems]:
            raise ValueError(f"step {step + 1}: the rollout ranks sent prompts {[p.id for p in scored.problems]}, this "
                             f"actor rank's loader has {[p.id for p in mine]} (did they resume from the same checkpoint?)")
        return scored, {s.source: s.report for s in shipments}, time.perf_counter() - t

    def _update_waits(self) -> dict[int, list]:
        """Actor rank 0: each rollout rank's [seconds waiting for the push, seconds loading it, its
        idle work's metrics of the step]."""
        return {src: _receive_object(src, "receiving the rollout ranks' wait for the push") for src in self.p.rollout_ranks}

    def step(self) -> StepResult:
        t_step = time.perf_counter()
        step = self.step_index
        received, self.pending = self.pending or self._receive(step), None
        scored, reports, receive_s = received
        metrics, logprob_s, update_s = self.learner.train(scored, step)
        if self.tc.async_steps:
            self.pending = self._receive(step + 1)  # made with this step's policy while it trained
        sync = self.push(step + 1)
        waits = self._update_waits() if self.r.main else {}
        self.step_index = step + 1
        lengths = [int(x) for row in gather_floats(self.r, [float(x) for x in scored.lengths.tolist()]) for x in row]
        metrics.update(self._step_metrics(scored, reports, waits, receive_s, logprob_s, update_s, sync,
                                          time.perf_counter() - t_step))
        return StepResult(metrics=metrics, lengths=lengths, rollouts=scored, decode_steps=[])

    def _step_metrics(self, scored, reports, waits, receive_s, logprob_s, update_s, sync, step_s) -> dict[str, float]:
        m = {"step": float(self.step_index), "timing/step": step_s, "timing/receive": receive_s,
             "timing/logprob": logprob_s, "timing/update": update_s, "timing/sync": sync.get("timing/sync", 0.0),
             "world_size": float(self.p.job.world), "actor_ranks": float(self.r.world)}
        m.update({k: v for k, v in sync.items() if k.startswith("sync/")})
        if waits:
            reports = {g: dataclasses.replace(r, idle_s=r.idle_s + waits[g][0]) for g, r in reports.items()}
            m.update({f"timing/update_idle/rank{g}": w[0] for g, w in waits.items()})
            m.update(waits[self.p.first_rollout][2])
        m.update(rollout_metrics(reports))
        m["reward/std"] = float(scored.rewards.std()) if scored.rewards.numel() > 1 else 0.0
        m["rollout/policy_version"] = float(scored.batch.policy_version)
        m["engine/version"] = float(self.step_index)
        return m

    def evaluate(self) -> float | None:
        """Held-out accuracy, evaluated by the first rollout rank (actor rank 0 receives it)."""
        if not self.r.main:
            return None
        return _receive_object(self.p.first_rollout, "receiving the held-out accuracy")

    def save(self) -> None:
        """A run checkpoint (collective over the actor group), its components the first rollout rank's
        step hooks' state (`{hook.name: state}`); the engine serves the version of the step saved."""
        components = {}
        if self.r.main:
            components = _receive_object(self.p.first_rollout, "receiving the rollout engine's state for a checkpoint")
        state = RunState(step=self.step_index, loader=self.loader.state_dict(), engine_version=self.step_index,
                         components=components)
        save_run(checkpoint_dir(self.run_dir, self.step_index), state, self.actor, None, main=self.r.main)


def _receive_object(src: int, what: str):
    box = [None]
    with transfer(f"{what} (from rank {src})"):
        dist.recv_object_list(box, src=src)
    return box[0]
