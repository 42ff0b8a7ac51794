"""Serverless executors: run N DiLoCo replicas as independent jobs that share nothing but the
object store, watch them, and collect what each returned.

A replica is a :class:`ReplicaSpec`: a Python entry point ``"pkg.module:function"`` and JSON-able
keyword arguments. Replica ``i`` of ``n`` calls ``function(replica_id=i, replicas=n, **kwargs)``;
the dict it returns (JSON-able) is its result. Every executor implements the
:class:`ServerlessExecutor` protocol:

* ``launch_replicas(spec, n)`` starts the replicas (each in a fresh process, job or container);
* ``poll()`` reports ``{replica: ReplicaStatus}`` (running / succeeded / failed, and the exit code
  where the backend has one) without blocking;
* ``stream_logs(replica, follow=False, timeout_s=...)`` yields the replica's output lines so far
  (``follow``: and then new ones until it ends, ExecutorError past ``timeout_s``);
* ``cancel(replica=None)`` stops one replica, or all, and waits until it is gone;
* ``collect(timeout_s)`` waits until every replica has ended and returns one
  :class:`ReplicaResult` each (status, exit code, the returned dict or the error); it raises
  :class:`ExecutorError` at the deadline (the replicas keep running: cancel them);
* ``backend_name`` names the backend; ``supports_inter_replica_network`` says whether replicas can
  reach each other directly. DiLoCo never needs that: the store is their only channel, which is
  what lets replicas run as serverless jobs in different places.

Shipped: ``LocalProcessExecutor`` (subprocesses on this machine, `local.py`) and
``MonarchJobExecutor`` (one host each on a Monarch job, `monarch_job.py`).

Cloud backends are extension points, not shipped. Each maps the protocol onto its job API and runs
the same per-replica command, ``python -m meshrl.diloco.executors.replica_main`` (which needs only
meshrl installed in the image and the store's credentials in the environment):

* Modal: ``launch_replicas`` calls a ``modal.Function`` wrapping `replica_main.run_spec` with
  ``.spawn(...)`` once per replica (a ``FunctionCall`` each); ``poll`` is ``FunctionCall.get(timeout=0)``,
  ``collect`` ``get(timeout=...)`` (the returned dict travels back as the call's value); ``cancel``
  is ``FunctionCall.cancel()``; logs come from Modal's log stream of the app.
* Hugging Face Jobs: ``huggingface_hub.run_job(image=..., command=[python, -m, ...replica_main, ...])``
  per replica; ``poll`` maps ``inspect_job(...).status.stage`` (RUNNING, COMPLETED, ERROR, CANCELED);
  ``stream_logs`` is ``fetch_job_logs(job_id, follow=...)``; ``cancel`` is ``cancel_job``; results
  are written by the replica to the object store (``--result s3://...``) and read back by ``collect``.
* SLURM / Kubernetes batch: one array task or one Job per replica running the same command.

Such backends set ``supports_inter_replica_network = False``: nothing in DiLoCo needs it.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Literal, Protocol, runtime_checkable

State = Literal["pending", "running", "succeeded", "failed", "cancelled"]
ENDED: tuple[State, ...] = ("succeeded", "failed", "cancelled")


class ExecutorError(RuntimeError):
    """Replicas could not be launched, or did not end within a deadline (one line naming which)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica runs: ``entry`` = ``"pkg.module:function"``, called with
    ``replica_id``, ``replicas`` and ``kwargs`` (JSON-able: they cross process and job boundaries)."""

    entry: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        module, sep, name = self.entry.partition(":")
        if not (module and sep and name):
            raise ValueError(f"entry {self.entry!r}: expected 'pkg.module:function'")
        try:
            json.dumps(self.kwargs)
        except TypeError as e:
            raise ValueError(f"kwargs of {self.entry} must be JSON-able: {e}") from None

    def function(self) -> Callable[..., dict]:
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)

    def run(self, replica_id: int, replicas: int) -> dict:
        """Run replica ``replica_id`` of ``replicas`` here; its result (a dict, checked JSON-able)."""
        result = self.function()(replica_id=replica_id, replicas=replicas, **self.kwargs)
        if not isinstance(result, dict):
            raise TypeError(f"{self.entry} returned {type(result).__name__}, not a dict")
        json.dumps(result)
        return result

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ReplicaSpec":
        return cls(**json.loads(text))


@dataclass
class ReplicaStatus:
    state: State
    exit_code: int | None = None
    """The process's exit status where the backend has one (negative: killed by that signal)."""

    @property
    def ended(self) -> bool:
        return self.state in ENDED


@dataclass
class ReplicaResult:
    replica: int
    status: ReplicaStatus
    result: dict | None = None
    """What the replica's function returned (None unless it succeeded)."""
    error: str | None = None
    """Why it did not succeed (the exception's last line, or how the process ended)."""


@runtime_checkable
class ServerlessExecutor(Protocol):
    backend_name: str
    supports_inter_replica_network: bool

    def launch_replicas(self, spec: ReplicaSpec, n: int) -> None: ...

    def poll(self) -> dict[int, ReplicaStatus]: ...

    def stream_logs(self, replica: int, follow: bool = False, timeout_s: float = 3600.0) -> Iterator[str]: ...

    def cancel(self, replica: int | None = None) -> None: ...

    def collect(self, timeout_s: float) -> dict[int, ReplicaResult]: ...


def read_lines(path, ended: Callable[[], bool] | None = None, timeout_s: float = 3600.0,
               poll_s: float = 0.1) -> Iterator[str]:
    """The lines of the log file at ``path`` (without newlines); with ``ended``, keep following
    the file until ``ended()`` and everything written is read (ExecutorError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    pos, partial = 0, ""
    while True:
        done = ended is None or ended()  # checked before reading: nothing written before the end is missed
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
        except FileNotFoundError:
            chunk = ""
        *lines, partial = (partial + chunk).split("\n")
        yield from lines
        if done:
            if partial:
                yield partial
            return
        if time.monotonic() > deadline:
            raise ExecutorError(f"{path}: the replica was still running after {timeout_s:.0f}s of following its log")
        time.sleep(poll_s)
