"""MonarchJobExecutor: each replica is a host of its own on a Monarch job, with one process and one
small `ReplicaActor` on it. The actor's ``run`` endpoint calls the spec's function and returns
``{"result": ...}`` or ``{"error": ...}``; the executor waits on the endpoint futures.

The job comes from the launcher the executor is given (`JobLauncher`: e.g.
`meshrl.launch.process.replica_job`, a ProcessJob with a worker process per host on this machine,
reached over ipc://, exactly as remote hosts would be); the executor asks it whether a replica's
host is alive and has it killed.

* ``poll``: a replica whose future resolved has succeeded or failed; one whose host worker process
  is gone has failed (Monarch itself only notices a lost host after
  HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE); the rest are running. Monarch gives no exit code.
* ``stream_logs``: the actor sends its output (prints and log records) to
  ``<work_dir>/replica-<i>.log``; that needs a work dir both sides see (true for ProcessJob; on
  remote hosts use the launcher's log forwarding, `launch.forward_logs`).
* ``cancel``: kills the replica's host worker and its processes (their session), or the whole job.

``supports_inter_replica_network`` is True (Monarch meshes can message each other), but DiLoCo
replicas use only the object store.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from monarch.actor import Actor, endpoint

from meshrl.diloco.executors.base import ExecutorError, ReplicaResult, ReplicaSpec, ReplicaStatus, read_lines
from meshrl.diloco.executors.replica_main import output_to, run_spec

WAIT_SLICE_S = 1.0  # a waiter thread's longest block on a future before it looks at the replica's host


class ReplicaActor(Actor):
    """Runs one replica in its own process (sync endpoint: the call occupies the actor)."""

    def __init__(self, spec_json: str, replicas: int, log_path: str):
        self.spec = ReplicaSpec.from_json(spec_json)
        self.replicas, self.log_path = replicas, Path(log_path)

    @endpoint
    def run(self, replica: int) -> dict:
        with output_to(self.log_path):
            return run_spec(self.spec, replica, self.replicas)


class JobLauncher(Protocol):
    """The Monarch job of the replicas, one host each (e.g. `meshrl.launch.process.ProcessLauncher`)."""

    def start(self) -> Any:
        """Start the job; its hosts (`host_mesh(name)` gives a host mesh's Monarch HostMesh)."""

    def host_alive(self, name: str, index: int = 0) -> bool:
        """Whether host ``index`` of host mesh ``name`` is still running."""

    def kill_host(self, name: str, index: int = 0) -> None:
        """Kill host ``index`` of host mesh ``name`` and everything running on it."""

    def stop(self) -> None:
        """Kill the whole job (idempotent)."""


class MonarchJobExecutor:
    backend_name = "monarch-job"
    supports_inter_replica_network = True

    def __init__(self, work_dir: str | Path, launcher_for: Callable[[dict[str, int], str], JobLauncher],
                 run_id: str | None = None):
        """``launcher_for(hosts, run_id)`` builds the job's launcher for host meshes ``{name: 1}``."""
        self.work_dir = Path(work_dir)
        self.run_id = run_id or f"diloco-{uuid.uuid4().hex[:8]}"
        self.launcher_for = launcher_for
        self.launcher: JobLauncher | None = None
        self._n = 0
        self._outcomes: dict[int, dict] = {}  # replica -> {"result"|"error": ...} once its call ended
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    def _host(self, i: int) -> str:
        return f"replica_{i}"

    def log_path(self, replica: int) -> Path:
        return self.work_dir / f"replica-{replica}.log"

    def launch_replicas(self, spec: ReplicaSpec, n: int) -> None:
        if self.launcher is not None:
            raise ExecutorError(f"{self.backend_name}: replicas already launched ({self.run_id})")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._n = n
        self.launcher = self.launcher_for({self._host(i): 1 for i in range(n)}, self.run_id)
        hosts = self.launcher.start()
        futures = []
        try:
            for i in range(n):
                self.log_path(i).unlink(missing_ok=True)
                procs = hosts.host_mesh(self._host(i)).spawn_procs(per_host={"procs": 1}, name=f"replica{i}")
                actor = procs.spawn("replica", ReplicaActor, spec.to_json(), n, str(self.log_path(i)))
                futures.append(actor.run.call_one(i))
        except BaseException:
            self.close()
            raise
        for i, future in enumerate(futures):
            threading.Thread(target=self._wait, args=(i, future), name=f"diloco-replica-{i}", daemon=True).start()

    def _wait(self, i: int, future) -> None:
        """Record replica ``i``'s outcome once its call returns; give up when it was cancelled or
        its host is gone (poll reports those)."""
        while i not in self._cancelled and self._host_alive(i):
            try:
                out = future.get(timeout=WAIT_SLICE_S)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - ActorError, SupervisionError: the replica failed
                out = {"error": f"{type(e).__name__}: {e}".strip().splitlines()[0]}
            with self._lock:
                self._outcomes[i] = out
            return

    def _host_alive(self, i: int) -> bool:
        launcher = self.launcher
        return launcher is not None and launcher.host_alive(self._host(i))

    def _status(self, i: int) -> ReplicaStatus:
        with self._lock:
            out = self._outcomes.get(i)
        if out is not None:
            return ReplicaStatus("succeeded" if "result" in out else "failed")
        if i in self._cancelled:
            return ReplicaStatus("cancelled")
        return ReplicaStatus("running" if self._host_alive(i) else "failed")

    def poll(self) -> dict[int, ReplicaStatus]:
        return {i: self._status(i) for i in range(self._n)}

    def stream_logs(self, replica: int, follow: bool = False, timeout_s: float = 3600.0) -> Iterator[str]:
        return read_lines(self.log_path(replica), (lambda: self._status(replica).ended) if follow else None, timeout_s)

    def cancel(self, replica: int | None = None) -> None:
        if self.launcher is None:
            return
        targets = range(self._n) if replica is None else [replica]
        for i in targets:
            if not self._status(i).ended:
                self._cancelled.add(i)
                self.launcher.kill_host(self._host(i))

    def collect(self, timeout_s: float) -> dict[int, ReplicaResult]:
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self.poll()
            if all(s.ended for s in statuses.values()):
                break
            if time.monotonic() > deadline:
                running = [i for i, s in statuses.items() if not s.ended]
                raise ExecutorError(f"replicas {running} still running after {timeout_s:.0f}s "
                                    f"(logs in {self.work_dir})")
            time.sleep(0.1)
        results = {}
        for i, status in statuses.items():
            out = self._outcomes.get(i, {})
            error = out.get("error") or (None if "result" in out else
                                         f"{status.state}: the replica's host process exited without a result")
            results[i] = ReplicaResult(i, status, out.get("result"), error)
        return results

    def close(self) -> None:
        """Kill the job (every replica's host and process)."""
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            self._cancelled.update(i for i in range(self._n) if i not in self._outcomes)
            launcher.stop()

    def __enter__(self) -> "MonarchJobExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
