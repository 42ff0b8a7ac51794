"""Run checkpoints: `checkpoints/step-NNNNNN/` holding the learner's state (`learner/`) and the
controller's (`controller.json`: step, data cursor, policy version, counters, channel state).

A checkpoint is written into a hidden temporary directory and renamed into place only when every
part is on disk, so the newest `step-*` directory is always complete; leftovers of an interrupted
write are ignored and cleaned up.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

COMPLETE = "COMPLETE"
CONTROLLER = "controller.json"
LEARNER_DIR = "learner"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    state: dict

    @property
    def learner_dir(self) -> Path:
        return self.path / LEARNER_DIR


class CheckpointManager:
    """Atomic, pruned checkpoints under ``root``."""

    def __init__(self, root: Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``step`` (learner writes into it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / LEARNER_DIR).mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, state: dict) -> Checkpoint:
        """Add the controller state, mark complete, rename into place, prune old checkpoints."""
        (tmp / CONTROLLER).write_text(json.dumps({"step": step, **state}, indent=1))
        (tmp / COMPLETE).write_text("ok\n")
        _fsync_dir(tmp)
        final = self.root / f"step-{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return Checkpoint(step, final, {"step": step, **state})

    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.glob("step-*")):
            if (d / COMPLETE).is_file() and (d / CONTROLLER).is_file():
                state = json.loads((d / CONTROLLER).read_text())
                out.append(Checkpoint(int(state["step"]), d, state))
        return sorted(out, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        found = self.complete()
        return found[-1] if found else None

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
