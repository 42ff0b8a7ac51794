"""What every launcher does: turn the `launch:` section into a Monarch job, start it, hand its
host meshes to the runtime as `Hosts`, and kill it on every way out.

A launcher is a thin owner of a Monarch `JobTrait` (LocalJob, ProcessJob, SlurmJob,
KubernetesJob): `job()` builds it, `start()` applies it and attaches to its host meshes,
`stop()` kills it (idempotent). `dry_run()` describes what would be submitted without doing it.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from meshrl.config.launch import LaunchConfig
from meshrl.meshes.hosts import Hosts

log = logging.getLogger("meshrl")

RUN_ID_ENV = "MESHRL_RUN_ID"
"""Every host worker (and so every actor process) of a run has its run id in this variable."""


class LaunchError(RuntimeError):
    """The job could not be submitted or its hosts did not come up (one line naming the cause)."""


class Launcher(ABC):
    """One run's Monarch job. ``run_dir`` holds what the launcher writes (batch scripts, logs,
    manifests); None = nothing to write (dry runs print instead)."""

    kind: str = ""

    def __init__(self, cfg: LaunchConfig, run_id: str, run_dir: Path | None = None):
        self.cfg = cfg
        self.run_id = run_id
        self.run_dir = run_dir
        self._job: Any = None
        self._forwarding_before: bool | None = None  # the client's log forwarding before `start` turned it on

    def worker_env(self) -> dict[str, str]:
        """Environment every host worker gets: the run id and the `launch.env` variables that are
        set here."""
        env = {name: os.environ[name] for name in self.cfg.env if name in os.environ}
        env[RUN_ID_ENV] = self.run_id
        return env

    @abstractmethod
    def job(self) -> Any:
        """The Monarch job for this config (built, not yet applied)."""

    def lost_hosts(self) -> dict[str, set[int]]:
        """Hosts known to be gone now, by host mesh (launchers that cannot tell say none)."""
        return {}

    def dry_run(self, out_dir: Path | None = None) -> str:
        """What `start()` would submit, as text (and files under ``out_dir`` where that applies)."""
        return f"launcher {self.kind}: host meshes " + ", ".join(f"{n} x{c}" for n, c in self.cfg.hosts.items()) + "\n"

    def start(self) -> Hosts:
        """Apply the job, attach to its host meshes and return them (the job is killed again if
        that fails)."""
        forward = self.cfg.forward_logs and self.kind != "local"
        if forward:  # must be configured before any proc mesh exists
            from monarch.config import configure, get_global_config

            self._forwarding_before = bool(get_global_config()["enable_log_forwarding"])
            configure(enable_log_forwarding=True)
        self._job = self.job()
        try:
            state = self._job.state(cached_path=None)
            meshes = {name: getattr(state, name) for name in self.cfg.hosts}
            self.after_start(meshes)
        except BaseException as e:
            self.stop()
            if isinstance(e, Exception) and not isinstance(e, LaunchError):
                raise LaunchError(f"launcher {self.kind}: the job did not start: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
            raise
        log.info("launcher %s: run %s on host meshes %s", self.kind, self.run_id,
                 ", ".join(f"{n} x{c}" for n, c in self.cfg.hosts.items()))
        return Hosts(meshes, self.cfg, self.lost_hosts, _stream_logs if forward else None, label_logs=self.kind != "local")

    def after_start(self, host_meshes: dict[str, Any]) -> None:
        """Hook for launchers that must do something once the hosts are up."""

    def stop(self) -> None:
        """Kill the job (idempotent; errors are logged, never raised: this runs on every exit), and
        give the client back the log forwarding it had before `start`: it is process-wide, and with
        it on, stopping a later mesh whose process has died waits for that process's logs until
        Monarch gives up (tens of seconds)."""
        job, self._job = self._job, None
        self.restore_log_forwarding()
        if job is None:
            return
        try:
            job.kill()
        except Exception as e:  # noqa: BLE001 - shutdown is best effort
            log.warning("launcher %s: killing the job failed: %s", self.kind, e)

    def restore_log_forwarding(self) -> None:
        """The client's log forwarding as it was before `start` (idempotent)."""
        if self._forwarding_before is not None:
            from monarch.config import configure

            configure(enable_log_forwarding=self._forwarding_before)
            self._forwarding_before = None

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stream_logs(proc_mesh) -> None:
    """Stream a proc mesh's stdout/stderr to the controller, line by line, each prefixed with its
    host and rank by Monarch."""
    import asyncio

    asyncio.run(proc_mesh.logging_option(stream_to_client=True, aggregate_window_sec=None, level=logging.WARNING))
