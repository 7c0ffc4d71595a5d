"""RequestSource: requests handed to a running generate() as its rows free up.

A generate() call given a source asks it, before every admission, for more requests; what it
returns is admitted like the call's own requests (after them, in the order returned), so the
continuous batch is fed while it runs (work stealing: pipeline.rollout.stealing). The source decides how
much to hand out from the rows active and free; the engine never holds requests back. Sampling
noise is keyed by (seed, step, prompt id, sample, position), so when or where a request is
admitted changes none of its tokens.
"""

from __future__ import annotations

from typing import Protocol

from engine.types import Request


class RequestSource(Protocol):
    def pull(self, active: int, free: int) -> list[Request] | None:
        """Requests to admit now, given the rows `active` and the slots `free` (not yet promised to
        requests already handed out): [] for none now, None once the source has nothing left (it is
        not asked again)."""
        ...
