"""Snapshots of LoRA tenants: an adapter's whole training state (weights, LoRA config, AdamW state,
step count) copied between two calls, and written to disk by a background thread.

`AdapterState` is the copy: taken on the learner's own thread between two calls (after an
`optim_step`, nothing is accumulated), so it is the state of a completed step however the live
tensors change while it is written. `write_adapter` writes one into a temporary sibling directory
and renames it into place, so a reader never sees a partial one (the format of `LoraTenants.save`).

`SnapshotWriter` writes them in the background: ``<root>/<adapter>/<mark>`` (``mark``, a number the
caller chooses that grows with each snapshot of an adapter), then deletes that adapter's older
snapshots. At most one snapshot per adapter waits (a newer one replaces it) and one is written at a
time, so the cost stays at two copies of each adapter's state in memory and one on disk.
`latest_snapshot` finds the newest complete one, which is what survives if the process dies at any
moment (a directory appears only once complete).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

WEIGHTS, CONFIG, OPTIMIZER, META = "adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "tenant.json"
_TMP = ".tmp-"


@dataclass
class AdapterState:
    """Copies (on the CPU) of one adapter's training state."""

    name: str
    weights: dict[str, torch.Tensor]
    config: Any  # peft LoraConfig
    optimizer: dict
    steps_applied: int
    optimizer_type: str
    """Which optimizer ``optimizer`` is the state of (meshrl.training.optimizers.OPTIMIZERS)."""


def cpu_copy(obj):
    """``obj`` (tensors in dicts, lists, tuples) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def write_adapter(state: AdapterState, directory: Path) -> None:
    """Write ``state`` into ``directory`` (replaced if it exists) through a temporary sibling."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{_TMP}{directory.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in state.weights.items()}, str(tmp / WEIGHTS))
        state.config.save_pretrained(str(tmp))
        torch.save(state.optimizer, tmp / OPTIMIZER)
        (tmp / META).write_text(json.dumps({"name": state.name, "steps_applied": state.steps_applied,
                                            "optimizer": state.optimizer_type}))
        _move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _move_into_place(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        tmp.rename(directory)
        return
    old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
    directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def latest_snapshot(root: Path, name: str) -> tuple[int, Path] | None:
    """(mark, directory) of adapter ``name``'s newest complete snapshot under ``root``, or None."""
    marks = [int(d.name) for d in (Path(root) / name).glob("*") if d.name.isdigit() and d.is_dir()]
    return (max(marks), Path(root) / name / str(max(marks))) if marks else None


def clear_partial(root: Path, name: str) -> None:
    """Delete what a writer that died left of adapter ``name``'s snapshots: temporary directories."""
    for d in (Path(root) / name).glob(f"{_TMP}*"):
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class _Task:
    root: Path
    mark: int | None  # None: delete the adapter's snapshots
    state: AdapterState | None = None


class SnapshotWriter:
    """A background thread writing adapter snapshots, newest first per adapter (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pending: dict[str, _Task] = {}  # adapter -> its next task (a newer one replaces it)
        self._busy: str | None = None  # the adapter being written
        self._durable: dict[str, int] = {}  # adapter -> mark of its newest snapshot on disk
        self._failed: dict[str, str] = {}  # adapter -> why its last write failed
        self._thread: threading.Thread | None = None

    def submit(self, state: AdapterState, root: Path, mark: int) -> None:
        """Write ``state`` as snapshot ``mark`` of its adapter under ``root`` (in the background)."""
        self._queue(state.name, _Task(Path(root), mark, state))

    def discard(self, name: str, root: Path) -> None:
        """Drop adapter ``name``'s waiting snapshot and delete its snapshots (in the background)."""
        self._queue(name, _Task(Path(root), None))

    def durable(self, name: str) -> int | None:
        """The mark of adapter ``name``'s newest snapshot on disk (None: none yet)."""
        with self._lock:
            return self._durable.get(name)

    def wait(self, name: str, timeout_s: float) -> int | None:
        """Wait until adapter ``name`` has nothing waiting or being written; its durable mark.
        RuntimeError if its last write failed, TimeoutError after ``timeout_s``."""
        with self._lock:
            if not self._lock.wait_for(lambda: name not in self._pending and self._busy != name, timeout_s):
                raise TimeoutError(f"snapshot of LoRA adapter {name!r} not written within {timeout_s:g}s")
            if name in self._failed:
                raise RuntimeError(self._failed[name])
            return self._durable.get(name)

    def _queue(self, name: str, task: _Task) -> None:
        with self._lock:
            self._pending[name] = task
            self._failed.pop(name, None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adapter-snapshots", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending)
                name = next(iter(self._pending))
                task = self._pending.pop(name)
                self._busy = name
            try:
                self._do(name, task)
            except Exception as e:  # noqa: BLE001 - reported to a waiter; the previous snapshot stays
                log.warning("snapshot of LoRA adapter %r failed: %s", name, e)
                with self._lock:
                    self._failed[name] = f"snapshot of LoRA adapter {name!r} failed: {type(e).__name__}: {e}"
            finally:
                with self._lock:
                    self._busy = None
                    self._lock.notify_all()

    def _do(self, name: str, task: _Task) -> None:
        folder = task.root / name
        if task.mark is None:
            shutil.rmtree(folder, ignore_errors=True)
            with self._lock:
                self._durable.pop(name, None)
            return
        write_adapter(task.state, folder / str(task.mark))
        with self._lock:
            self._durable[name] = task.mark
        for older in folder.glob("*"):
            if older.name.isdigit() and int(older.name) < task.mark:
                shutil.rmtree(older, ignore_errors=True)
