"""When a rank puts the features it stashed while generating into the node's DataBuffer.

As its idle window opens, a rank puts every stash, so that the entries of this step are there to
train on while the window lasts. The rank that finished last does not: nobody is left to train on
them this step, and the put would be on the step's critical path. It holds its newest
`HELD_STEPS` stashes (this step's, and one from being last before) until its next window as an
early rank; a held step's entries are then the previous step's long responses that the
sampler's offset mixes in.
"""

from __future__ import annotations

HELD_STEPS = 2  # stashes the last rank holds back at most


def stashes_to_hold(window) -> int:
    """How many of its newest stashes a rank keeps back as `window` (a common.idle.IdleWindow) opens."""
    return HELD_STEPS if window.opened_last else 0
