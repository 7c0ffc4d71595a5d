"""The spot-training config section (`spot:` in configs/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spot.training.step import DrafterOptim


@dataclass(kw_only=True)
class SpotConfig:
    enabled: bool = False  # train the engine's EAGLE drafter online
    # colocated: the rollout ranks train it in their idle windows (spot.coordinator); pool: an
    # external elastic pool (launch.spot_pool) trains it from this job's buffer, and the ranks
    # load its newest publication from pool_dir every step (spot.pool.follower).
    mode: Literal["colocated", "pool"] = "colocated"
    pool_dir: str | None = None  # the pool's --out folder (mode: pool)
    # The job's buffer name: each node's segment in /dev/shm is <buffer_name>-<node> (spot.buffer.segment);
    # None: tailspec-<run folder>-<node>.
    buffer_name: str | None = None
    # The node's DataBuffer (spot.buffer.ring): a ring of rollouts' features in /dev/shm.
    buffer_mb: int = 256
    buffer_entries: int = 4096  # header slots (entries held at most)
    feature_dtype: Literal["float32", "bfloat16"] = "float32"
    # Sampling: entries per micro-step, and the share of the previous step's long responses.
    rows_per_step: int = 16
    offset_ratio: float = 0.25
    window: int = 256  # pairs per packed window
    # Windows per forward/backward within a micro-step (gradients accumulated): the unit an idle
    # window's end stops training in, and the activations held while another rank still generates.
    chunk_windows: int = 1
    max_micro_steps: int | None = None  # per idle window; None: until the window ends
    # The drafter's optimiser (`optim()`): warmup, then constant (spot.training.trainer); the rest is TLT's recipe.
    lr: float = 1.0e-4
    warmup_steps: int = 0
    weight_decay: float = DrafterOptim.weight_decay
    grad_clip: float = DrafterOptim.grad_clip
    ce_weight: float = DrafterOptim.ce_weight

    def optim(self) -> DrafterOptim:
        """The drafter's optimiser (spot.pool.elastic.PoolConfig builds a pool's from keys of the same names)."""
        return DrafterOptim.from_config(self, "spot.")

    def validate(self) -> None:
        if self.mode == "pool" and not self.pool_dir:
            raise ValueError("spot.mode=pool needs spot.pool_dir (the --out folder of launch.spot_pool)")
        for key in ("buffer_mb", "buffer_entries", "rows_per_step", "window", "chunk_windows"):
            if getattr(self, key) < 1:
                raise ValueError(f"spot.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_micro_steps is not None and self.max_micro_steps < 1:
            raise ValueError(f"spot.max_micro_steps must be >= 1 or null (until the window ends), got {self.max_micro_steps}")
        if not 0 <= self.offset_ratio <= 1:
            raise ValueError(f"spot.offset_ratio must be in [0, 1], got {self.offset_ratio}")
        self.optim()  # ValueError naming a bad optimiser key
