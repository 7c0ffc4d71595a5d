"""PromptLoader: which problems each RL step trains on, per rank, resumable to the step.

Vocabulary: an *epoch* is one pass over the problems in an order keyed by `(seed, epoch)`; a
*step* takes the next `prompts_per_step` problems of that order (the *global step*); each rank
gets a contiguous *shard* of it, so concatenating the shards in rank order gives the global
step, and the global step is the same whatever the world size (a resume may change it).

Steps never straddle an epoch: the last `len(problems) % prompts_per_step` problems of an
epoch's order are skipped (they differ from one epoch to the next). Straddling would let the
end of one epoch and the start of the next put the same problem twice in one step, where both
copies would get the same noise keys and so the same rollouts.

The order comes from `random.Random(f"{seed}:{epoch}")` (string seeds are hashed with SHA-512,
so the order is the same in every process and Python run); no global RNG is read or changed.

*Stratified* epochs (`sizes` given: one number per problem, larger = a longer response expected)
give every step one problem of each size stratum: the epoch's problems, sorted by size, are cut
into `prompts_per_step` strata of one problem per step each, every stratum is shuffled, and step
s takes the s-th problem of every stratum, in shuffled order. An epoch takes the problems a
shuffled epoch would (all but the same remainder), each once, and every step holds the size
distribution of the whole set: its longest problem comes from the top stratum. This is what a
step of hundreds of prompts has by the law of large numbers, and what a miniature's step of 16
shuffled prompts lacks in about one step of ten (docs/ARCHITECTURE.md, "Prompt order").

This module knows nothing about tasks, tokenizers or rollouts: a problem is any object, and its
size is the caller's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

P = TypeVar("P")


def epoch_order(num_problems: int, seed: int, epoch: int, *, sizes: Sequence[float] | None = None,
                per_step: int = 1) -> list[int]:
    """The problem indices of `epoch` in the order its steps (`per_step` problems each) take them.

    Without `sizes` a shuffle; with them (one per problem) stratified: the first
    num_problems // per_step * per_step problems of that shuffle, one of each size stratum per step.
    """
    order = list(range(num_problems))
    rng = random.Random(f"{seed}:{epoch}")
    rng.shuffle(order)
    if sizes is None:
        return order
    if len(sizes) != num_problems:
        raise ValueError(f"got {len(sizes)} sizes for {num_problems} problems: give one size per problem")
    steps = num_problems // per_step
    ranked = sorted(order[:steps * per_step], key=lambda i: sizes[i])  # stable: ties keep the shuffle's order
    strata = [ranked[k * steps:(k + 1) * steps] for k in range(per_step)]  # smallest sizes first
    for stratum in strata:
        rng.shuffle(stratum)
    stratified = []
    for s in range(steps):
        step = [stratum[s] for stratum in strata]
        rng.shuffle(step)  # no rank's shard holds the same strata every step
        stratified.extend(step)
    return stratified + order[steps * per_step:]


class PromptLoader(Generic[P]):
    def __init__(self, problems: Sequence[P], prompts_per_step: int, seed: int, *, world_size: int = 1,
                 rank: int = 0, sizes: Sequence[float] | None = None) -> None:
        """`sizes`: one per problem, for stratified epochs (the module's docstring); None: shuffled."""
        if not problems:
            raise ValueError("PromptLoader needs at least one problem (the task produced none)")
        if not 1 <= prompts_per_step <= len(problems):
            raise ValueError(f"prompts_per_step must be in 1..{len(problems)} (the number of problems), "
                             f"got {prompts_per_step}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1 with world_size >= 1, got rank {rank} of "
                             f"{world_size}")
        if prompts_per_step % world_size:
            raise ValueError(f"prompts_per_step ({prompts_per_step}) must be divisible by the world size "
                             f"({world_size}) so that every rank rolls out as many prompts")
        self.problems = list(problems)
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.sizes = None if sizes is None else list(sizes)  # epoch_order checks there is one per problem
        self.steps_per_epoch = len(self.problems) // prompts_per_step
        self._taken = 0  # steps taken since epoch 0 began
        self._order_cache: tuple[int, list[int]] = (0, self._epoch_order(0))

    @property
    def epoch(self) -> int:
        return self._taken // self.steps_per_epoch

    @property
    def position(self) -> int:
        """Steps already taken in the current epoch."""
        return self._taken % self.steps_per_epoch

    def global_step(self, ahead: int = 1) -> list[P]:
        """All ranks' prompts of the step next_step() reaches `ahead` calls from now."""
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1 (1 = the next step), got {ahead}")
        taken = self._taken + ahead - 1
        epoch, position = divmod(taken, self.steps_per_epoch)
        start = position * self.prompts_per_step
        return [self.problems[i] for i in self._order(epoch)[start:start + self.prompts_per_step]]

    def peek(self, ahead: int = 1) -> list[P]:
        """This rank's prompts of the step next_step() returns `ahead` calls from now; does not advance."""
        shard = self.prompts_per_step // self.world_size
        return self.global_step(ahead)[self.rank * shard:(self.rank + 1) * shard]

    def next_step(self) -> list[P]:
        """This rank's prompts of the next step; advances by one step."""
        prompts = self.peek()
        self._taken += 1
        return prompts

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "prompts_per_step": self.prompts_per_step, "num_problems": len(self.problems),
                "stratified": self.sizes is not None}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken (the world size may differ; the data may not)."""
        for key in ("seed", "prompts_per_step", "num_problems"):
            mine = len(self.problems) if key == "num_problems" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]}, this loader {mine}: resuming with "
                                 "other data or batch settings would change which problems each step takes")
        stratified = state.get("stratified", False)  # states saved before stratified epochs were shuffled
        if stratified != (self.sizes is not None):
            orders = {True: "stratified", False: "shuffled"}
            raise ValueError(f"loader state comes from {orders[stratified]} epochs, this loader's are "
                             f"{orders[self.sizes is not None]}: resume with trainer.prompt_order="
                             f"{orders[stratified]}, the run's own setting")
        if not 0 <= state["position"] < self.steps_per_epoch or state["epoch"] < 0:
            raise ValueError(f"loader state epoch {state['epoch']}, position {state['position']} is out of "
                             f"range (steps per epoch: {self.steps_per_epoch})")
        self._taken = state["epoch"] * self.steps_per_epoch + state["position"]

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache[0] != epoch:
            self._order_cache = (epoch, self._epoch_order(epoch))
        return self._order_cache[1]

    def _epoch_order(self, epoch: int) -> list[int]:
        return epoch_order(len(self.problems), self.seed, epoch, sizes=self.sizes, per_step=self.prompts_per_step)
