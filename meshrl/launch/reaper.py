"""`python -m meshrl.launch.reaper CONTROLLER_PID WORKER_PID...`: waits for the controller to
exit, then SIGKILLs every process in the workers' sessions. Started by the process launcher in a
session of its own, so a controller killed with SIGKILL (which runs no cleanup) leaves no workers."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil


def reap(controller: int, workers: list[int], poll_s: float = 0.5) -> None:
    """Block while ``controller`` runs; then kill the sessions led by ``workers``."""
    try:
        watched = psutil.Process(controller)
        while watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE:
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass
    kill_sessions(workers)


def kill_sessions(leaders: list[int]) -> None:
    """SIGKILL every process still in a session one of ``leaders`` started (a host worker and the
    actor processes it spawned)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) in leaders:
                os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue


if __name__ == "__main__":
    reap(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
