"""Rollout ranks of a run whose drafter is trained by an external spot pool (spot.pool.elastic).

With `spot.mode: pool` the RL job does not train the drafter itself: its engines' feature sink
fills the node's DataBuffer as each rank's idle window opens (named `spot.buffer_name`, so that
`launch.spot_pool` members can attach to it), and once per step, in the idle window where every rank is present, rank 0 reads
the pool's newest publication (`<spot.pool_dir>/published/LATEST`) and tells the others its
version through the job's TCPStore, so every rank loads the same drafter before the next step.
A version is loaded once; a publication removed between the read and the load is skipped until
the next step.
"""

from __future__ import annotations

from common.idle import IdleWork
from spot.pool.elastic import latest_published, published_weights
from spot.buffer.sink import put_as_window_opens


class PoolFollower(IdleWork):
    """Fills the buffer and picks up the pool's drafters in the idle window (common.idle.IdleWork)."""

    name = "spot"

    def __init__(self, engine, buffer, sink, pool_dir: str, store, rank: int) -> None:
        self.engine, self.buffer, self.sink, self.pool_dir = engine, buffer, sink, pool_dir
        self.store, self.rank = store, rank
        self.drafter_version = 0

    def rollouts_done(self, step: int, batch) -> None:
        self.sink.stash(batch.rollouts, step)

    def _newest(self, step: int, scope: str) -> int:
        """The version every rank loads at this step (rank 0 reads the pool's folder)."""
        key = f"{scope}/spot/pool_version/{step}"
        if self.rank == 0:
            latest = latest_published(self.pool_dir)
            version = latest[0] if latest else 0
            if self.store is not None:
                self.store.set(key, str(version))
            return version
        return int(self.store.get(key).decode())

    def work(self, window) -> dict[str, float]:
        put_as_window_opens(self.sink, window)  # the pool trains on them while the step goes on
        version = self._newest(window.step, window.scope)
        if version > self.drafter_version:
            path = self._folder(version)
            try:
                weights = published_weights(path) if path is not None else None
            except FileNotFoundError:  # pruned between the look and the read: the next step tries anew
                weights = None
            if weights is not None:
                self.engine.load_drafter_weights(weights, version=version)
                self.drafter_version = version
        return {"spot/drafter_version": float(self.drafter_version), **self.buffer.stats()}

    def _folder(self, version: int):
        try:
            latest = latest_published(self.pool_dir)
        except ValueError:
            return None
        if latest is None:
            return None
        folder = latest[1].parent / f"v{version}"
        return folder if folder.is_dir() else None
