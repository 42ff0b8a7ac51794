"""Processes and uids of sandboxed runs on the host: whether the host is root, the children of a
process, killing every process of a uid, and ``_UidLease``, the exclusive per-run uid (an flock
shared by every process of the host)."""

from __future__ import annotations

import os
import signal
import threading
import time


def _is_root() -> bool:
    return os.geteuid() == 0


def _proc_children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        # kernels without CONFIG_PROC_CHILDREN: scan for the parent pid
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return kids


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid == uid:
                pids.append(int(d))
        except OSError:
            continue
    return pids


def _kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process owned by ``uid`` until none is left; the number killed."""
    me = os.getpid()
    killed = 0
    for _ in range(rounds):
        pids = [p for p in _pids_of_uid(uid) if p != me]
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed


class _UidLease:
    """Exclusive use of one sandbox uid, across threads *and processes* of this host (several
    Sandbox instances, rewarder actors, environment servers): an flock on a root-only lock file,
    released when the run ends or the holder dies."""

    LOCK_DIR = "/tmp/meshrl-sandbox-uids"
    POOL = 1024
    _local = threading.Lock()

    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, base: int, sweep: bool) -> "_UidLease":
        import fcntl

        from meshrl.envs.sandbox import SandboxUnavailable

        with cls._local:
            os.makedirs(cls.LOCK_DIR, mode=0o700, exist_ok=True)
            st = os.lstat(cls.LOCK_DIR)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not os.path.isdir(cls.LOCK_DIR):
                raise SandboxUnavailable(f"{cls.LOCK_DIR} must be a directory owned by uid {os.geteuid()} with mode 0700")
        deadline = time.monotonic() + 60
        while True:
            for i in range(cls.POOL):
                uid = base + i
                fd = os.open(os.path.join(cls.LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if sweep:
                    _kill_uid(uid)  # leftovers of a holder that died mid-run
                return cls(uid, fd)
            if time.monotonic() > deadline:
                raise SandboxUnavailable(f"all {cls.POOL} sandbox uids from {base} are in use")
            time.sleep(0.01)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1
