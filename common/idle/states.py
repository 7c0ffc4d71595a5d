"""The control plane: every rank's (step, state) in the job's store (torch.distributed's TCPStore).

No Redis, ZMQ or Ray: a rank sets its own key, anyone reads all of them without a collective.
The states of one RL step on a rank:

    GENERATING --rollouts done--> IDLE --> PREGENERATING (bubble drafts, pipeline.drafts.bubble)
                                       --> TRAINING (spot training, spot.coordinator)
                                       --last rank done--> BARRIER
"""

from __future__ import annotations

import enum


class RankState(str, enum.Enum):
    GENERATING = "generating"
    IDLE = "idle"
    TRAINING = "training"
    PREGENERATING = "pregenerating"  # bubble drafts: the next step's rollouts, pre-generated
    BARRIER = "barrier"


class ControlPlane:
    """Every rank's (step, state) in a store (a torch.distributed Store: TCPStore in a job)."""

    def __init__(self, store, rank: int, world: int, prefix: str = "tailspec/control") -> None:
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix

    def set(self, step: int, state: RankState) -> None:
        self.store.set(f"{self.prefix}/state/{self.rank}", f"{step} {state.value}")

    def states(self) -> list[tuple[int, RankState] | None]:
        """Each rank's last (step, state), None for a rank that never set one."""
        out = []
        for r in range(self.world):
            key = f"{self.prefix}/state/{r}"
            if not self.store.check([key]):
                out.append(None)
                continue
            step, state = self.store.get(key).decode().split()
            out.append((int(step), RankState(state)))
        return out
