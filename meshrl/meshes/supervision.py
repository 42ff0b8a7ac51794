"""Supervision at the root: Monarch's default unhandled-fault hook exits the controller
(`sys.exit(1)`, seen as a KeyboardInterrupt). We replace it with a recorder, so a child's death
becomes an event the training loop handles instead of the end of the run."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailureEvent:
    """One supervision event: which mesh failed, when, and Monarch's readable report."""

    mesh_name: str
    time: float
    report: str


class FailureLog:
    """Thread-safe record of supervision events (the hook runs on Monarch's event-loop thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[FailureEvent] = []

    def record(self, failure) -> None:
        try:
            report = failure.report()
        except Exception:  # noqa: BLE001 - a report we cannot render is still an event
            report = repr(failure)
        name = str(getattr(failure, "mesh_name", "<unknown>"))
        event = FailureEvent(name, time.time(), report)
        with self._lock:
            self.events.append(event)
        log.warning("supervision event from mesh %s: %s", name, report.strip().splitlines()[0] if report else "")

    def since(self, index: int) -> list[FailureEvent]:
        with self._lock:
            return list(self.events[index:])

    def __len__(self) -> int:
        with self._lock:
            return len(self.events)


def install_fault_hook() -> FailureLog:
    """Route unhandled child failures to a FailureLog instead of exiting the controller."""
    import monarch.actor

    failures = FailureLog()
    monarch.actor.unhandled_fault_hook = failures.record
    return failures
