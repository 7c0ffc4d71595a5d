"""The data path of a separated placement: a step's scored rollouts from the rollout ranks to the
actor ranks that train them.

Vocabulary: the step's prompt *groups* are numbered in the loader's global order
(pipeline.shares); rollout rank j generates `generation_shares(P, R)[j]` (with split groups: its
part of every group, the same n / R samples of each), actor rank k trains `shard_shares(P, K)[k]`
(what colocated rank k would train). A *shipment* is what one rollout rank sends one actor rank
for one step: the groups of its generation that the actor trains (maybe none; with split groups,
its part of each), with their problems, prompt ids, rollouts (tokens, engine log-probs, finish
reasons, versions), rewards, and the sender's `RolloutReport`. `unpack` joins a split group's
parts in sample order. Every rollout rank sends every actor rank one shipment per step, so an
actor rank hears from all of them (their reports feed the step's metrics) and the send and
receive orders never cross: senders go through the actor ranks in order, receivers through the
rollout ranks in order.

`pack_shipments` and `unpack` are pure (tested in one process); `send_shipments` /
`receive_shipments` move them point to point between global ranks (pickled through the job's
group: gloo on CPU, CPU tensors on GPU jobs too). Decode step records stay on the rollout rank,
which logs them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.types import Rollout, RolloutBatch
from pipeline.rollout.stage import ScoredRollouts
from pipeline.rollout.report import RolloutReport
from pipeline.tasks import Problem


@dataclass(kw_only=True)
class RolloutShipment:
    step: int  # the RL step (0-based) the rollouts are for
    source: int  # the sending rollout rank (global)
    groups: list[int]  # global group indices, ascending
    problems: list[Problem]  # one per group
    prompts: list[list[int]]  # their token ids
    rollouts: list[Rollout]  # n per group, in group order (a split group's part: n of its samples)
    rewards: torch.Tensor  # [len(groups) * n] float
    n: int
    report: RolloutReport  # the sender's whole step, not only these groups

    def __post_init__(self) -> None:
        g = len(self.groups)
        if len(self.problems) != g or len(self.prompts) != g or len(self.rollouts) != g * self.n:
            raise ValueError(f"shipment from rank {self.source}: {g} groups, {len(self.problems)} problems, "
                             f"{len(self.prompts)} prompts and {len(self.rollouts)} rollouts (n={self.n}) do not match")
        if self.rewards.shape != (g * self.n,):
            raise ValueError(f"shipment from rank {self.source}: rewards of shape {tuple(self.rewards.shape)}, "
                             f"expected ({g * self.n},)")

    @classmethod
    def make_dummy(cls, step: int = 0, source: int = 0, groups: tuple[int, ...] = (0, 1), n: int = 2) -> RolloutShipment:
        """A shipment with distinct values in every field, for tests."""
        from engine.types import FinishReason

        rollouts = [Rollout(prompt_id=f"p{g}", sample=s, prompt_tokens=3 + g, tokens=[g + 5, s + 7, 2][: 2 + s % 2],
                            logprobs=[-0.5 - g, -0.25 * s, -1.0][: 2 + s % 2], policy_version=step,
                            finish_reason=FinishReason.STOP if s % 2 else FinishReason.LENGTH)
                    for g in groups for s in range(n)]
        report = RolloutReport(rollout_s=1.5 + source, idle_s=0.25, new_tokens=float(sum(len(r.tokens) for r in rollouts)),
                               reward_sum=1.0, rollouts=float(len(rollouts)), accept_len=2.5, speculative_steps=4.0,
                               accepted=6.0, drafted=9.0, prefill_s=0.125)
        return cls(step=step, source=source, groups=list(groups),
                   problems=[Problem(id=f"p{g}", prompt=f"{g}+1=", answer=str(g + 1), response=str(g + 1)) for g in groups],
                   prompts=[[1, 4 + g, 9] for g in groups], rollouts=rollouts,
                   rewards=torch.arange(len(rollouts), dtype=torch.float32) / 4, n=n, report=report)


def pack_shipments(scored: ScoredRollouts, groups: list[int], actor_shares: list[list[int]], step: int, source: int,
                   report: RolloutReport) -> list[RolloutShipment]:
    """One shipment per actor rank: the groups of `scored` (this rank's generation, whose global
    indices are `groups`) that actor rank k trains, for k in order."""
    n = scored.n
    where = {g: i for i, g in enumerate(groups)}
    out = []
    for share in actor_shares:
        mine = [g for g in share if g in where]
        rows = [where[g] * n + s for g in mine for s in range(n)]
        out.append(RolloutShipment(step=step, source=source, groups=mine, problems=[scored.problems[where[g]] for g in mine],
                                   prompts=[scored.prompts[where[g]] for g in mine],
                                   rollouts=[scored.batch.rollouts[i] for i in rows],
                                   rewards=scored.rewards[rows].clone(), n=n, report=report))
    return out


def unpack(shipments: list[RolloutShipment], share: list[int], step: int, n: int) -> ScoredRollouts:
    """An actor rank's rollouts of `step`, in global group order, from every rollout rank's
    shipment, the parts of a split group joined in sample order; raises ValueError unless they are
    exactly the groups of `share`, of that step, each with its n samples."""
    stale = [s.source for s in shipments if s.step != step]
    if stale:
        raise ValueError(f"rollouts for step {step + 1} expected, rank(s) {stale} sent another step's: the actor and "
                         "rollout ranks disagree on the step (are trainer.async_steps and trainer.resume the same on all?)")
    # group -> its parts (one, or a split group's one per rollout rank): (shipment, index in it)
    parts: dict[int, list[tuple[RolloutShipment, int]]] = {}
    for s in shipments:
        for i, g in enumerate(s.groups):
            parts.setdefault(g, []).append((s, i))
    if sorted(parts) != list(share):
        raise ValueError(f"step {step + 1}: received groups {sorted(parts)}, this actor rank trains {share}")
    # group -> (rollout, reward, the rollout rank that generated it), in sample order
    rows = {g: sorted(((ro, float(r), s.source) for s, i in ps for ro, r in zip(s.rollouts[i * s.n : (i + 1) * s.n],
                                                                                   s.rewards[i * s.n : (i + 1) * s.n])),
                      key=lambda x: x[0].sample)
            for g, ps in parts.items()}
    for g, r in rows.items():
        if [ro.sample for ro, _, _ in r] != list(range(n)):
            raise ValueError(f"step {step + 1}: group {g} arrived with samples {[ro.sample for ro, _, _ in r]}, not 0..{n - 1}: "
                             "the rollout and actor ranks disagree on rollout.n or rollout.split_groups")
    order = list(share)
    rollouts = [ro for g in order for ro, _, _ in rows[g]]
    versions = {ro.policy_version for ro in rollouts}
    batch = RolloutBatch(rollouts=rollouts, steps=[], prefill_s=0.0, wall_s=0.0,
                         policy_version=min(versions) if versions else 0)
    first = {g: ps[0] for g, ps in parts.items()}
    return ScoredRollouts(problems=[first[g][0].problems[first[g][1]] for g in order],
                          prompts=[first[g][0].prompts[first[g][1]] for g in order], batch=batch,
                          rewards=torch.tensor([r for g in order for _, r, _ in rows[g]], dtype=torch.float32), n=n,
                          generated_on=[k for g in order for _, _, k in rows[g]])


def send_shipments(shipments: list[RolloutShipment], actor_ranks: tuple[int, ...]) -> None:
    """shipments[k] to actor_ranks[k], in order."""
    for ship, dst in zip(shipments, actor_ranks, strict=True):
        dist.send_object_list([ship], dst=dst)


def receive_shipments(rollout_ranks: tuple[int, ...]) -> list[RolloutShipment]:
    """One shipment from each rollout rank, in order."""
    out = []
    for src in rollout_ranks:
        box = [None]
        dist.recv_object_list(box, src=src)
        if box[0].source != src:
            raise ValueError(f"a shipment from rank {src} names rank {box[0].source} as its source")
        out.append(box[0])
    return out
