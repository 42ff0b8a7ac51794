"""LocalProcessExecutor: each replica is a subprocess on this machine
(``python -m meshrl.diloco.executors.replica_main``) in a session of its own, with its output in
``<work_dir>/replica-<i>.log`` and its result in ``<work_dir>/replica-<i>.json``.

``supports_inter_replica_network`` is False: the replicas could reach each other over loopback,
but the executor promises nothing of the kind, exactly as a serverless backend would not; they
share nothing but the object store (and this work dir, which only the executor reads).
Processes are only ever signalled through the executor's own ``Popen`` handles, and only while
unreaped, so a recycled PID or another user's process is never hit; cancel kills the replica's
whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from meshrl.diloco.executors.base import ExecutorError, ReplicaResult, ReplicaSpec, ReplicaStatus, read_lines


class LocalProcessExecutor:
    backend_name = "local-process"
    supports_inter_replica_network = False

    def __init__(self, work_dir: str | Path, python: str = sys.executable, env: dict[str, str] | None = None,
                 cancel_timeout_s: float = 30.0):
        """``env``: the replicas' environment (default: this process's)."""
        self.work_dir = Path(work_dir)
        self.python, self.env, self.cancel_timeout_s = python, env, cancel_timeout_s
        self._procs: list[subprocess.Popen] = []
        self._cancelled: set[int] = set()

    def log_path(self, replica: int) -> Path:
        return self.work_dir / f"replica-{replica}.log"

    def result_path(self, replica: int) -> Path:
        return self.work_dir / f"replica-{replica}.json"

    def launch_replicas(self, spec: ReplicaSpec, n: int) -> None:
        if self._procs:
            raise ExecutorError(f"{self.backend_name}: replicas already launched in {self.work_dir}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.work_dir / "spec.json"
        spec_path.write_text(spec.to_json())
        for i in range(n):
            self.result_path(i).unlink(missing_ok=True)
            with open(self.log_path(i), "wb") as log:
                self._procs.append(subprocess.Popen(
                    [self.python, "-m", "meshrl.diloco.executors.replica_main", "--spec", str(spec_path),
                     "--replica", str(i), "--replicas", str(n), "--result", str(self.result_path(i))],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                    start_new_session=True))

    def pid(self, replica: int) -> int:
        """The PID of replica ``replica``'s process (the leader of its process group)."""
        return self._procs[replica].pid

    def _status(self, i: int) -> ReplicaStatus:
        rc = self._procs[i].poll()
        if rc is None:
            return ReplicaStatus("running")
        if i in self._cancelled:
            return ReplicaStatus("cancelled", rc)
        return ReplicaStatus("succeeded" if rc == 0 else "failed", rc)

    def poll(self) -> dict[int, ReplicaStatus]:
        return {i: self._status(i) for i in range(len(self._procs))}

    def stream_logs(self, replica: int, follow: bool = False, timeout_s: float = 3600.0) -> Iterator[str]:
        proc = self._procs[replica]
        return read_lines(self.log_path(replica), (lambda: proc.poll() is not None) if follow else None, timeout_s)

    def cancel(self, replica: int | None = None) -> None:
        targets = range(len(self._procs)) if replica is None else [replica]
        for i in targets:
            proc = self._procs[i]
            if proc.poll() is None:  # unreaped: the PID (and its group) is still ours
                self._cancelled.add(i)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i in targets:
            try:
                self._procs[i].wait(timeout=self.cancel_timeout_s)
            except subprocess.TimeoutExpired:
                raise ExecutorError(f"replica {i} (pid {self._procs[i].pid}) still alive "
                                    f"{self.cancel_timeout_s:.0f}s after SIGKILL") from None

    def collect(self, timeout_s: float) -> dict[int, ReplicaResult]:
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [i for i, p in enumerate(self._procs) if p.poll() is None]
                raise ExecutorError(f"replicas {running} still running after {timeout_s:.0f}s "
                                    f"(logs in {self.work_dir})") from None
        return {i: self._result(i) for i in range(len(self._procs))}

    def _result(self, i: int) -> ReplicaResult:
        status = self._status(i)
        try:
            out = json.loads(self.result_path(i).read_text())
        except FileNotFoundError:
            out = {"error": _ended_without_result(status)}
        if "result" in out and status.state == "succeeded":
            return ReplicaResult(i, status, out["result"])
        return ReplicaResult(i, status, error=out.get("error") or _ended_without_result(status))

    def __enter__(self) -> "LocalProcessExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def _ended_without_result(status: ReplicaStatus) -> str:
    code = status.exit_code
    if code is not None and code < 0:
        return f"{status.state}: killed by {signal.Signals(-code).name}"
    return f"{status.state}: exited with status {code} without a result"
