"""What a replacement learner needs to take over from one that died: each live tenant's newest
snapshot on disk and the learner calls it has completed since, and where each weight version that
samplers may still ask for can be published again from.

A tenant's learner calls, by kind:

- `ACCUMULATE` (forward_backward, forward_backward_custom, scale_grads) and `STEP` (optim_step)
  are logged when they complete, each with a mark that grows with every logged call. After an
  optim_step the learner copies the tenant's state and writes it to disk in the background as a
  snapshot at that step's mark (meshrl.training.snapshots); when the learner reports a snapshot on
  disk, the calls up to its mark leave the log. The log so holds the calls since the newest
  snapshot on disk: the current step's, and the last step's while its snapshot is being written.
- `RESET` (add_adapter, load_adapter) set the whole state: their snapshot is written before the
  call returns, and the tenant's log starts over from it. They are never replayed (a load would
  read a checkpoint that may have changed since).
- Any other call (forward, save_adapter, publish, use_adapter) changes no tenant's training state.

`restore_tenants` loads each tenant's newest snapshot into the replacement learner and replays the
logged calls after its mark, in order: the same calls on the same state give the same gradients
and the same steps (with `learner.lora.dropout` > 0, a replayed forward_backward draws a fresh
dropout mask). `republish` publishes the `weight_sync.keep_versions` newest versions again, in
order, from the sampler checkpoints they were published from (the base model: the learner's own
`default` adapter), since published weights live in the learner's memory. Those checkpoints are
kept under ``root/.versions`` as hard links (copies where links fail) when they are published, so
a checkpoint deleted or saved again under the same name later does not change them.
"""

from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from meshrl.training.tenants import DEFAULT

ACCUMULATE = frozenset({"forward_backward", "forward_backward_custom", "scale_grads"})
"""Learner calls that add to a tenant's accumulated gradients: logged, replayed."""
STEP = "optim_step"
"""The call that completes a step: logged, replayed, then snapshotted in the background."""
RESET = frozenset({"add_adapter", "load_adapter"})
"""Calls that set a tenant's whole state (the first argument names it): snapshotted before they
return, never replayed."""
SCRATCH = "republish"
"""The adapter a replacement learner loads saved sampler weights into to publish them again."""

Call = Callable[..., Any]
"""``call(endpoint, *args)`` on the learner; the reply."""


@dataclass(frozen=True)
class LoggedCall:
    mark: int
    endpoint: str
    args: tuple


class LearnerJournal:
    """The tenants' logs and the published versions' sources; snapshots live under ``root``."""

    def __init__(self, root: Path, keep_versions: int):
        self.root = Path(root)
        self.keep_versions = keep_versions
        self._marks = itertools.count(1)
        self._logs: dict[str, list[LoggedCall]] = {}  # tenant -> calls since its newest snapshot on disk
        self._versions: dict[int, Path | None] = {}  # version -> sampler checkpoint (None: the base model)

    @property
    def tenants(self) -> list[str]:
        return list(self._logs)

    def log_of(self, name: str) -> list[LoggedCall]:
        return list(self._logs.get(name, ()))

    def next_mark(self) -> int:
        return next(self._marks)

    def reset(self, name: str) -> None:
        """Tenant ``name`` (new or not) starts over from a snapshot just written by a `RESET` call."""
        self._logs[name] = []

    def completed(self, name: str | None, endpoint: str, args: tuple) -> int | None:
        """Log a completed call of tenant ``name`` if it changes its training state; after an
        optim_step, the mark to snapshot the tenant at."""
        calls = self._logs.get(name)
        if calls is None or not (endpoint in ACCUMULATE or endpoint == STEP):
            return None
        mark = self.next_mark()
        calls.append(LoggedCall(mark, endpoint, tuple(args)))
        return mark if endpoint == STEP else None

    def durable(self, name: str, mark: int | None) -> None:
        """Tenant ``name``'s snapshot ``mark`` is on disk: the calls up to it leave the log."""
        if mark is not None and name in self._logs:
            self._logs[name] = [c for c in self._logs[name] if c.mark > mark]

    def removed(self, name: str) -> None:
        self._logs.pop(name, None)

    def published(self, version: int, source: Path | None) -> None:
        """``version`` was published from the sampler checkpoint ``source`` (None: the base model):
        keep its files for a replacement learner, as long as the version is among the kept ones."""
        kept = None
        if source is not None:
            kept = self.root / ".versions" / str(version)
            _link_files(Path(source), kept)
        self._versions[version] = kept
        for old in sorted(self._versions)[:-self.keep_versions]:
            if self._versions.pop(old) is not None:
                shutil.rmtree(self.root / ".versions" / str(old), ignore_errors=True)

    def republish(self, call: Call) -> list[int]:
        """On a replacement learner: publish the kept versions again, oldest first; the versions
        published. Leaves `default` active."""
        scratch = False
        for version, source in sorted(self._versions.items()):
            if source is None:
                call("use_adapter", DEFAULT)
            else:
                call("load_adapter", SCRATCH, str(source), False)
                call("use_adapter", SCRATCH)
                scratch = True
            call("publish", version)
        call("use_adapter", DEFAULT)
        if scratch:
            call("remove_adapter", SCRATCH)
        return sorted(self._versions)

    def restore_tenants(self, call: Call) -> dict[str, int]:
        """On a replacement learner: every tenant from its newest snapshot, then the calls logged
        after it, replayed in order; the number replayed per tenant. Leaves the last one active."""
        replayed = {}
        for name, calls in self._logs.items():
            mark = call("restore_adapter", name, str(self.root))["mark"]
            call("use_adapter", name)
            todo = [c for c in calls if c.mark > mark]
            for c in todo:
                call(c.endpoint, *c.args)
            replayed[name] = len(todo)
        return replayed


def _link_files(source: Path, target: Path) -> None:
    """``target`` holds the files of ``source`` as hard links (copies where linking fails)."""
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            try:
                os.link(f, target / f.name)
            except OSError:
                shutil.copy2(f, target / f.name)
