"""Recovery of failed meshes: detect, replace, re-sync, re-issue — within a restart budget.

Every remote call of the loop runs through `Supervisor.run(mesh, fn, what)`. `fn` issues the call
on the *current* actor mesh and waits with a deadline. If the process died (SupervisionError), the
endpoint raised (ActorError) or the deadline passed (a hung actor), the damaged proc mesh is
stopped and replaced, the new actors are brought back to the run's state by the mesh's re-sync
hook (e.g. generators pull the current weight version), and `fn` runs again. Calls are
idempotent — generation is seeded per batch and nothing is trained until a call has returned —
so no group is lost and none is trained twice. A learner failure is not retried here: it raises
`LearnerLost` and the training loop resumes from the last checkpoint. The API replaces its learner
with `recover` itself, through a learner re-sync hook that brings its tenants back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, TypeVar

from meshrl.config.faults import FaultsConfig
from meshrl.config.meshes import LEARNER
from meshrl.meshes.group import first_line

log = logging.getLogger(__name__)
T = TypeVar("T")


class CallTimeout(RuntimeError):
    """A remote call did not answer within its deadline (treated as a hung actor)."""


class ProcessDied(RuntimeError):
    """A process serving a call was found dead while the call was in flight."""


WATCH_INTERVAL_S = 0.25


def wait_all(futures: list, timeout_s: float, what: str, watch: Callable[[], str | None] | None = None) -> list:
    """Wait for every future with one shared deadline (CallTimeout names the call). While
    waiting, ``watch()`` is asked every 0.25 s whether a process serving the call has died
    (ProcessDied): on one host this sees a SIGKILL within a poll, even when Monarch's own report
    of the death takes longer."""
    deadline = time.monotonic() + timeout_s
    out = []
    for fut in futures:
        while True:
            remaining = max(deadline - time.monotonic(), 0.001)  # a reply already here is taken even past the deadline
            try:
                out.append(fut.get(timeout=min(remaining, WATCH_INTERVAL_S) if watch else remaining))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise CallTimeout(f"{what} timed out after {timeout_s:g}s") from None
                reason = watch() if watch else None
                if reason:
                    raise ProcessDied(f"{what}: {reason}") from None
    return out


class MeshLost(RuntimeError):
    """A mesh failed; carries the mesh name and a one-line cause."""

    def __init__(self, mesh: str, cause: str):
        super().__init__(f"mesh '{mesh}' failed: {cause}")
        self.mesh, self.cause = mesh, cause


class LearnerLost(MeshLost):
    """The learner (or a mesh sharing its processes) failed: resume from the last checkpoint."""


class RestartBudgetExceeded(RuntimeError):
    """A mesh failed more often than `faults.max_restarts` within `faults.restart_window_s`."""


def process_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when a process serving it died or hung (an endpoint that raised is an
    `ActorError` instead, and its actor lives on)."""
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    return (SupervisionError, CallTimeout, ProcessDied)


def recoverable_errors() -> tuple[type[BaseException], ...]:
    from monarch.actor import ActorError

    return (*process_errors(), ActorError)


class Supervisor:
    """Runs remote calls with replacement of failed meshes and a restart budget per mesh."""

    def __init__(self, meshes, cfg: FaultsConfig):
        self.meshes = meshes
        self.cfg = cfg
        self.resync: dict[str, Callable[[], None]] = {}
        self._restarts: dict[str, deque[float]] = {}
        self.restart_counts: dict[str, int] = {}
        self.recovery_seconds: list[float] = []
        self.events: list[dict] = []  # one per replacement: mesh, cause, recovery_s
        self._replaced: dict[str, int] = {}  # per mesh: how many times it has been replaced
        # one replacement at a time (re-entrant: a re-sync hook may itself recover)
        self._recovering = threading.RLock()

    def on_respawn(self, mesh: str, hook: Callable[[], None]) -> None:
        """Register how to bring a fresh actor mesh back to the run's current state."""
        self.resync[mesh] = hook

    def run(self, mesh: str, fn: Callable[[], T], what: str) -> T:
        """Call ``fn`` until it succeeds, replacing ``mesh`` after each failure (budgeted). Calls
        running at once on one mesh that fail together replace it once: a call whose mesh was
        replaced while it ran is issued again on the replacement."""
        errors = recoverable_errors()
        while True:
            replaced = self.replacements(mesh)
            try:
                return fn()
            except errors as e:
                cause = f"{what}: {first_line(e)}"
                if LEARNER in self.meshes.cohabitants(mesh):
                    raise LearnerLost(mesh, cause) from e
                self.recover_unless_replaced(mesh, replaced, cause)

    def replacements(self, mesh: str) -> int:
        """How many times ``mesh`` has been replaced so far."""
        return self._replaced.get(mesh, 0)

    def recover_unless_replaced(self, mesh: str, seen: int, cause: str) -> None:
        """Replace ``mesh`` unless it was replaced since a caller saw ``seen`` replacements (calls
        that fail together on one mesh replace it once)."""
        with self._recovering:
            if self.replacements(mesh) == seen:
                self.recover(mesh, cause)

    def charge(self, mesh: str, cause: str) -> None:
        """Count a restart of ``mesh``; raise if its budget for the window is spent."""
        now = time.monotonic()
        window = self._restarts.setdefault(mesh, deque())
        while window and now - window[0] > self.cfg.restart_window_s:
            window.popleft()
        if len(window) >= self.cfg.max_restarts:
            raise RestartBudgetExceeded(
                f"mesh '{mesh}' failed {len(window) + 1} times within {self.cfg.restart_window_s:g}s "
                f"(faults.max_restarts = {self.cfg.max_restarts}); last cause: {cause}"
            )
        window.append(now)
        self.restart_counts[mesh] = self.restart_counts.get(mesh, 0) + 1

    def recover(self, mesh: str, cause: str) -> float:
        """Replace ``mesh`` (and meshes sharing its processes), then re-sync them. Returns seconds."""
        with self._recovering:
            return self._recover(mesh, cause)

    def _recover(self, mesh: str, cause: str) -> float:
        self.charge(mesh, cause)
        detected_at = time.time()
        log.warning("recovering mesh '%s' after failure: %s", mesh, cause)
        started = time.perf_counter()
        names = self.meshes.respawn(mesh)
        for name in names:
            self._replaced[name] = self._replaced.get(name, 0) + 1
        for name in names:
            if name in self.resync:
                self.resync[name]()
        seconds = time.perf_counter() - started
        self.recovery_seconds.append(seconds)
        self.events.append({"mesh": mesh, "cause": cause, "action": "replaced and re-synced",
                            "recovery_s": seconds, "detected_at": detected_at})
        log.warning("mesh '%s' replaced and re-synced in %.2fs", mesh, seconds)
        return seconds

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"faults/restarts/{m}": float(n) for m, n in self.restart_counts.items()}
        out["faults/restarts_total"] = float(sum(self.restart_counts.values()))
        if self.recovery_seconds:
            out["faults/last_recovery_s"] = self.recovery_seconds[-1]
        return out
