"""The API's learner calls, serialised, with tenants that survive the learner process.

Calls of different training clients interleave one at a time; before each, the client's adapter is
made the active one (`use_adapter`). Each completed call is logged in the `LearnerJournal` (see
meshrl.api.journal for what is logged and when snapshots are written).

A learner whose process dies, or hangs past `learner.call_timeout_s`, is replaced by the
supervisor (`Supervisor.recover`: a new process, within `faults.max_restarts` per
`faults.restart_window_s`), whose re-sync hook (`restore`) publishes the kept weight versions
again and brings every tenant back to where its last completed call left it: its newest snapshot,
then the calls logged since, replayed. The generators switch weight versions only once the
versions are back. The call in flight is not issued again: it may be what killed the learner (a
LoRA rank that does not fit in memory killed every learner it reached), so it fails with the
cause (`LearnerFailed`) and changed nothing; its caller may send it again. A learner found dead
before a call is issued is replaced first, and the call then runs on the replacement. An endpoint
that raises is the caller's error and replaces nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from meshrl.api.journal import RESET, LearnerJournal
from meshrl.config.meshes import LEARNER
from meshrl.meshes.group import first_line
from meshrl.meshes.supervisor import process_errors
from meshrl.training.tenants import DEFAULT

log = logging.getLogger("meshrl")


class LearnerFailed(RuntimeError):
    """The learner died while running a call, which is not issued again."""


class TenantLearner:
    """The learner of ``client`` (a `MeshClient`) for many tenants, replaced through
    ``supervisor`` when it dies; ``versions_lock`` (what generators hold to switch weight
    versions) is held while a replacement brings the weight versions back; ``pids()`` names the
    learner's processes (for the log)."""

    def __init__(self, client, supervisor, journal: LearnerJournal, versions_lock: threading.Lock,
                 pids: Callable[[], Any]):
        self.client = client
        self.supervisor = supervisor
        self.journal = journal
        self._versions_lock = versions_lock
        self._pids = pids
        self._lock = threading.Lock()
        self._active: str | None = None
        self._next_version = 1  # 0 is the base model, published at start
        self.replacements: list[dict] = []  # one per replaced learner: versions, tenants, replayed calls, seconds
        supervisor.on_respawn(LEARNER, self.restore)

    def call(self, adapter: str | None, endpoint: str, args: tuple):
        """``endpoint(*args)`` with ``adapter`` active (None: whatever is active)."""
        with self._lock:
            return self._tenant_call(adapter, endpoint, args)

    def forget(self, adapter: str) -> None:
        """Remove ``adapter`` (its training client closed); `default` becomes active if it was."""
        with self._lock:
            self._tenant_call(DEFAULT if self._active == adapter else None, "remove_adapter", (adapter,))

    def publish(self, adapter: str, source: Path) -> int:
        """Publish ``adapter``'s weights as a new version; ``source``: the sampler checkpoint just
        saved from them (what a replacement learner publishes again). Returns the version."""
        with self._lock:
            version = self._next_version
            self._tenant_call(adapter, "publish", (version,))
            self._next_version += 1  # a publish that failed takes no version
            self.journal.published(version, source)
        return version

    def _on_learner(self, endpoint: str, *args):
        return self.client.on_learners(endpoint, *args, supervised=False)

    def _tenant_call(self, adapter: str | None, endpoint: str, args: tuple):
        def attempt():
            if adapter is not None and adapter != self._active:
                self._on_learner("use_adapter", adapter)
                self._active = adapter
            result = self._on_learner(endpoint, *args)
            if endpoint in RESET:  # on disk before the call counts as done: it is never replayed
                self._on_learner("snapshot_adapter", args[0], str(self.journal.root), self.journal.next_mark(), True)
                self.journal.reset(args[0])
            return result

        result = self._on_a_live_learner(f"learner.{endpoint}", attempt)
        if endpoint == "remove_adapter":
            self.journal.removed(args[0])
        mark = self.journal.completed(adapter, endpoint, args)
        if mark is not None:  # a completed step: snapshotted in the background
            try:
                reply = self._on_learner("snapshot_adapter", adapter, str(self.journal.root), mark, False)
                self.journal.durable(adapter, reply["durable"])
            except process_errors() as e:  # the step is in the journal: the replacement replays it
                self._replace(f"learner.snapshot_adapter: {first_line(e)}")
        return result

    def _on_a_live_learner(self, what: str, attempt: Callable[[], Any]):
        """``attempt()`` on a learner found alive (one found dead is replaced first); if the
        learner dies during it, it is replaced and the call fails (`LearnerFailed`), not issued
        again."""
        dead = self.client.meshes.dead_process(LEARNER)
        if dead:
            self._replace(f"{what}: {dead} (before the call was issued)")
        try:
            return attempt()
        except process_errors() as e:
            cause = f"{what}: {first_line(e)}"
            self._replace(cause)
            raise LearnerFailed(f"{cause}: the learner died during this call, which is not issued again (it may be "
                                "what killed it; every training client is back where its last completed call left "
                                "it)") from None

    def _replace(self, cause: str) -> None:
        """A new learner with every tenant restored, within the supervisor's restart budget
        (RestartBudgetExceeded past it); a replacement that dies too is replaced in turn."""
        with self._versions_lock:
            while True:
                try:
                    self.supervisor.recover(LEARNER, cause)
                    return
                except process_errors() as e:
                    cause = f"restoring a replaced learner: {first_line(e)}"

    def restore(self) -> None:
        """The learner's re-sync hook: the kept weight versions published again, every tenant
        restored (its newest snapshot and the calls logged since), `default` active."""
        started = time.perf_counter()
        self._active = None
        versions = self.journal.republish(self._on_learner)
        replayed = self.journal.restore_tenants(self._on_learner)
        self._on_learner("use_adapter", DEFAULT)
        self._active = DEFAULT
        event = {"versions": versions, "tenants": len(replayed), "replayed_calls": sum(replayed.values()),
                 "seconds": time.perf_counter() - started}
        self.replacements.append(event)
        log.warning("learner replaced (pids %s): weight versions %s published again, %d training clients restored "
                    "from their snapshots with %d logged calls replayed, in %.1fs", self._pids(), versions,
                    event["tenants"], event["replayed_calls"], event["seconds"])
