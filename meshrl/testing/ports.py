"""A free loopback TCP port, for the servers and process groups tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
