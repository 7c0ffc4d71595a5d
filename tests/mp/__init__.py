"""Workers of the multi-process tests (spawned; gloo on 127.0.0.1)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
