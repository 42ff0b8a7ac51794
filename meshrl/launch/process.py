"""`launch.launcher: process`: a real multi-host job on this machine (Monarch's ProcessJob): each
host is a worker process of its own, reached over `ipc://`, so meshes on different host meshes
talk as they would across machines (weights move by RDMA, over TCP here: nothing is shared
through this machine's memory between hosts). A lost host is a worker process that has exited."""

from __future__ import annotations

import logging
import subprocess

import psutil

from meshrl.transport.same_host import SIMULATED_HOSTS_ENV
from meshrl.launch.base import Launcher
from meshrl.launch.reaper import kill_sessions, start_reaper, stop_reaper

log = logging.getLogger("meshrl")


class ProcessLauncher(Launcher):
    """Host meshes of local worker processes; a reaper kills them if this controller dies
    without stopping the job (ProcessJob workers run in sessions of their own and would stay)."""

    kind = "process"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reaper: subprocess.Popen | None = None

    def job(self):
        from monarch.job import ProcessJob

        return ProcessJob(dict(self.cfg.hosts), env={**self.worker_env(), SIMULATED_HOSTS_ENV: "1"})

    def worker_pids(self) -> dict[tuple[str, int], int]:
        """``{(host mesh, index): worker pid}`` of the running job."""
        job = self._job
        if job is None:
            return {}
        table = job._host_to_pid  # ProcessJob keeps no public accessor for its workers
        return {(name, i): table[f"{name}_{i}"].pid for name, count in self.cfg.hosts.items() for i in range(count)}

    def after_start(self, host_meshes) -> None:
        self._reaper = start_reaper("kill-sessions", *map(str, sorted(self.worker_pids().values())))

    def host_alive(self, name: str, index: int = 0) -> bool:
        """Whether the worker process of host ``index`` of host mesh ``name`` is running."""
        pid = self.worker_pids().get((name, index))
        return pid is not None and _running(pid)

    def kill_host(self, name: str, index: int = 0) -> None:
        """Kill that host's worker and its processes (they share its session)."""
        pid = self.worker_pids().get((name, index))
        if pid is not None:
            kill_sessions([pid])

    def lost_hosts(self) -> dict[str, set[int]]:
        lost: dict[str, set[int]] = {}
        for (group, i), pid in self.worker_pids().items():
            if not _running(pid):
                lost.setdefault(group, set()).add(i)
        return lost

    def stop(self) -> None:
        pids = list(self.worker_pids().values())
        super().stop()
        kill_sessions(pids)  # anything job.kill() left: a worker's actor processes share its session
        stop_reaper(self._reaper)
        self._reaper = None


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def replica_job(hosts: dict[str, int], run_id: str) -> ProcessLauncher:
    """A ProcessJob with ``hosts`` (host mesh -> hosts) for jobs of independent replicas, e.g. a
    `meshrl.diloco.executors.monarch_job.MonarchJobExecutor`'s: Monarch faults of the replicas are
    recorded (meshrl.meshes.supervision), so a killed replica is an outcome, not the end of this
    process."""
    from meshrl.config.launch import LaunchConfig
    from meshrl.meshes.supervision import install_fault_hook

    install_fault_hook()
    return ProcessLauncher(LaunchConfig(launcher="process", hosts=dict(hosts), forward_logs=False), run_id)

