"""Common base of meshrl's sync actors."""

from __future__ import annotations

import os
import socket
import time

from monarch.actor import Actor, endpoint


def process_identity() -> dict:
    """Where an actor runs: its pid and host name (the controller watches and kills only the
    processes on its own host)."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


class InjectedFault(RuntimeError):
    """Raised by an endpoint armed with `inject_fault(..., "raise")`."""


class MeshrlActor(Actor):
    """A sync actor with an `info` endpoint (its reply also proves `__init__` has finished) and
    one-shot fault injection for the endpoints that call `fault_point`."""


    def describe(self) -> dict:
        """Extra fields for `info` (override)."""
        return {}

    @endpoint
    def info(self) -> dict:
        return {**process_identity(), **self.describe()}

    @endpoint
    def inject_fault(self, endpoint_name: str, action: str, seconds: float = 0.0) -> None:
        """Make the next call of ``endpoint_name`` sleep ``seconds`` (`delay`) or raise (`raise`)."""
        if action not in ("delay", "raise"):
            raise ValueError(f"unknown fault action {action!r}")
        self.__dict__.setdefault("_armed", {})[endpoint_name] = (action, seconds)

    def fault_point(self, endpoint_name: str) -> None:
        """Apply an armed fault for ``endpoint_name`` (once)."""
        armed = self.__dict__.get("_armed", {})
        if endpoint_name not in armed:
            return
        action, seconds = armed.pop(endpoint_name)
        if action == "delay":
            time.sleep(seconds)
        else:
            raise InjectedFault(f"injected fault in {endpoint_name}")
