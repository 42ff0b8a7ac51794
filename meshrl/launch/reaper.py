"""A watchdog for a controller that may die without cleaning up (SIGKILL runs no `finally`):

    python -m meshrl.launch.reaper CONTROLLER_PID kill-sessions WORKER_PID...
    python -m meshrl.launch.reaper CONTROLLER_PID scancel JOB_ID

waits for the controller to exit, then kills every process in the host workers' sessions (the
process launcher's ProcessJob workers run in sessions of their own) or cancels the SLURM job.
Launchers start it with `start_reaper`, in a session of its own, and kill it in `stop()`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

SCANCEL_TIMEOUT_S = 30.0


def start_reaper(action: str, *targets: str) -> subprocess.Popen:
    """Watch this process; on its exit run ``action`` (`kill-sessions` or `scancel`) on ``targets``."""
    return subprocess.Popen([sys.executable, "-m", "meshrl.launch.reaper", str(os.getpid()), action, *targets],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop_reaper(reaper: subprocess.Popen | None) -> None:
    """The controller cleans up itself: the watchdog is no longer needed."""
    if reaper is not None and reaper.poll() is None:
        reaper.kill()
        reaper.wait(timeout=30)


def wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Block while process ``pid`` runs (a zombie counts as exited)."""
    try:
        watched = psutil.Process(pid)
        while watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE:
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass


def kill_sessions(leaders: list[int]) -> None:
    """SIGKILL every process still in a session one of ``leaders`` started (a host worker and the
    actor processes it spawned)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) in leaders:
                os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue


def main(argv: list[str]) -> None:
    controller, action, targets = int(argv[0]), argv[1], argv[2:]
    wait_for_exit(controller)
    if action == "kill-sessions":
        kill_sessions([int(t) for t in targets])
    elif action == "scancel":
        subprocess.run(["scancel", *targets], capture_output=True, timeout=SCANCEL_TIMEOUT_S)
    else:
        raise SystemExit(f"reaper: unknown action {action!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
