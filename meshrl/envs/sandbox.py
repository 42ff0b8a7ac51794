"""Run untrusted code: bubblewrap namespaces + rlimits, or a weaker rlimit-only fallback.

``Sandbox(cfg).run(files, argv, timeout_s, stdin)`` writes ``files`` into a fresh private work
directory, runs ``argv`` there and returns an :class:`ExecResult`. It is thread-safe; up to
``cfg.max_parallel`` executions run at once (``run_many`` fans a batch out over threads, ``arun``
awaits one without blocking an event loop). ``Sandbox.probe()`` reports which layer works here.

Layers, and what each one guarantees
------------------------------------
``bwrap`` (bubblewrap; the default when it starts):

* **namespaces** -- new user, pid, network, ipc and uts namespaces (cgroup when possible), and
  ``--disable-userns`` so the code cannot create nested ones. *No network*: only a private
  loopback with nothing listening, so connects to host services (even 127.0.0.1) fail. *Own pid
  namespace*: host processes are invisible and cannot be signalled; the sandbox's init is immune to
  signals from inside, and killing it tears down every process of the sandbox at once.
* **filesystem** -- the root is empty: only the interpreter's runtime (``/usr/lib``,
  ``/usr/lib64``, the python binary itself, ``ld.so.cache``) is bound read-only, plus a private
  ``/proc`` and ``/dev``. The project checkout, ``/root``, ``/home``, ``/etc`` (so
  ``/etc/shadow``), the venv, site-packages with task references, and every other binary
  (no shell, no ``find``, no ``unzip``) are simply absent. ``/work`` (the work directory) and
  ``/tmp`` are size-capped tmpfs mounts private to this run: nothing written there reaches the host
  disk, and they vanish when the run ends. Files are copied in through memfds.
* **environment** -- ``--clearenv``: the host environment (API keys, the controller's settings) is
  never visible; only PATH/HOME/LANG/TMPDIR and a few PYTHON* settings (plus ``cfg.env``).
* **identity** -- when the host runs as root each execution runs as its own unprivileged uid,
  leased exclusively (flock, across every process of the host) from ``sandbox_uid_base`` on, with
  no supplementary groups; capabilities are dropped.
* **rlimits** (set inside, after the namespaces exist): RLIMIT_CPU (timeout + 1 s), RLIMIT_AS,
  RLIMIT_NPROC (counted per sandbox, because the count lives in the sandbox's user namespace),
  RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0.
  RLIMIT_NPROC needs a non-root *kernel* uid: root is exempt from it even inside a user
  namespace (bwrap maps the inner uid onto the caller's kuid 0 -- checked: a 256-process fork
  tree under RLIMIT_NPROC=20 is not stopped), hence the per-slot uid when the host is root.
  The processes also run at ``nice`` +10 so they yield the CPU to the generator and learner.
* **wall clock** -- the sandbox runs in its own session/process group; on timeout its init (and
  with it the whole pid namespace) and then the group are SIGKILLed. ``--die-with-parent`` kills it
  if the host process dies.
* **output** -- stdout/stderr are captured up to ``max_output_bytes`` each; past that the run is
  killed (``output_limit``) or drained.

``rlimit`` (fallback, when bwrap is missing or cannot create namespaces): a plain subprocess in a
fresh host temp directory with the same rlimits, a scrubbed environment, its own session killed on
timeout, and -- when the host is root -- a per-slot unprivileged uid whose every process is killed
after the run. It cannot contain network access, reading world-readable files (the project
checkout) or writing to world-writable places (``/tmp``); when not root it also cannot stop the
code from signalling the parent, reading the parent's environment through ``/proc``, escaping the
process group or forking without a per-sandbox ceiling; on either identity it can read other
processes' command lines in ``/proc`` (never pass secrets on a command line). ``ProbeResult.uncontained`` lists exactly
which hostile cases the running layer cannot contain, and the hostile test-suite skips those (with
that reason) instead of passing them falsely.

Not covered by either layer: CPU time shared with the host (no cgroup quota; wall and CPU limits
bound it). A program judged by the host talks to it over ``Sandbox.converse``'s two pipes (see
``meshrl.envs.grading``: the verdict never comes from inside the sandbox).

Error classification lives in ``meshrl.envs.exec_errors``, process/uid handling (killing a uid's
processes, the per-run uid lease) in ``meshrl.envs.sandbox_procs``, and the host side of a
conversation in ``meshrl.envs.sandbox_channel``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import posixpath
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

from meshrl.config.env import SandboxConfig
from meshrl.envs.exec_errors import classify
from meshrl.envs.sandbox_channel import Channel
from meshrl.envs.sandbox_procs import _is_root, _kill_uid, _proc_children, _UidLease

log = logging.getLogger(__name__)
T = TypeVar("T")

#: path of the work directory inside the bwrap sandbox
SANDBOX_WORKDIR = "/work"
#: uid/gid the code sees inside the bwrap sandbox's user namespace
SANDBOX_INNER_ID = 1000

#: hostile cases of the test-suite; a layer either contains a case or says why not
HOSTILE_CASES = (
    "infinite_loop",
    "sleep_past_timeout",
    "fork_bomb",
    "memory_bomb",
    "huge_output",
    "network_loopback",
    "read_project_file",
    "read_etc_shadow",
    "write_outside_workdir",
    "write_host_tmp",
    "env_secrets",
    "proc_parent_environ",
    "kill_parent",
    "import_reference",
    "escape_process_group",
    "disk_fill",
)

# Runs inside the sandbox before the real program: set the rlimits, then exec. Kept tiny and
# free of imports beyond os/resource so it starts fast. argv: LIMITS PROGRAM ARGS...
_WRAPPER = r"""
import os, resource, sys
for item in sys.argv[1].split(","):
    name, soft, hard = item.split(":")
    if name == "NICE":
        os.nice(int(soft))
    else:
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(soft), int(hard)))
os.umask(0o077)
argv = sys.argv[2:]
if argv[0] == "@py":
    # `python script.py args...`: run it in this interpreter instead of starting another one
    import runpy
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # report like `python script.py` would, without our frames
        import traceback
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(("<string>", "<frozen runpy")):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        raise SystemExit(1)
    raise SystemExit(0)
try:
    os.execv(argv[0], argv)
except OSError as e:
    sys.stderr.write("sandbox: cannot execute %s: %s\n" % (argv[0], e))
    sys.stderr.flush()
    os._exit(127)
"""

_EXEC_FAILED = 127


@dataclass
class ExecResult:
    """Outcome of one sandboxed execution."""

    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status of the program; None when it was killed by a signal."""
    timed_out: bool
    killed_signal: int | None
    """Signal that ended the program (SIGKILL after a timeout, SIGXCPU, SIGSEGV, ...), or None."""
    wall_s: float
    layer: str
    """Isolation layer that ran it: ``bwrap`` or ``rlimit``."""
    truncated: bool
    """Output past ``max_output_bytes`` was dropped."""
    error_kind: str | None
    """What went wrong (a key of ``meshrl.envs.base.ERROR_KINDS``), None for a clean exit 0."""
    cpu_s: float | None = None
    """User + system CPU seconds of the whole process tree that was reaped."""
    output_limited: bool = False
    """The run was killed because its output passed the cap."""
    stopped: bool = False
    """The program was killed because its conversation (``Sandbox.converse``) was over or gave up."""

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SandboxJob:
    """One execution for ``Sandbox.run_many``."""

    files: dict[str, str]
    argv: list[str]
    timeout_s: float | None = None
    stdin: str | None = None


@dataclass(frozen=True)
class ProbeResult:
    """Which isolation layer runs here, with what, and what it cannot contain."""

    layer: str
    """``bwrap`` or ``rlimit``."""
    python: str
    """Host path of the interpreter used inside the sandbox."""
    bwrap: str | None
    """bubblewrap binary used (None on the rlimit layer)."""
    drop_uid: bool
    """Slots run as their own unprivileged uid (host is root)."""
    disable_userns: bool = True
    """bwrap's --disable-userns is in effect."""
    reason: str = ""
    """Why a stronger layer was not used (empty when bwrap runs with every feature)."""
    uncontained: dict[str, str] = field(default_factory=dict)
    """Hostile case -> why this layer cannot contain it."""

    def contains(self, case: str) -> bool:
        if case not in HOSTILE_CASES:
            raise KeyError(f"unknown hostile case '{case}'")
        return case not in self.uncontained

    def describe(self) -> str:
        parts = [f"layer={self.layer}", f"python={self.python}", f"drop_uid={self.drop_uid}"]
        if self.layer == "bwrap":
            parts.append(f"disable_userns={self.disable_userns}")
        if self.reason:
            parts.append(f"reason: {self.reason}")
        if self.uncontained:
            parts.append("cannot contain: " + ", ".join(sorted(self.uncontained)))
        return "; ".join(parts)


class SandboxUnavailable(RuntimeError):
    """The requested isolation layer cannot run on this machine."""


# --------------------------------------------------------------------------- helpers


def _resolve_bwrap(path: str) -> str | None:
    if os.path.isabs(path):
        return path if os.access(path, os.X_OK) else None
    return shutil.which(path)


def _python_candidates(cfg: SandboxConfig) -> list[str]:
    if cfg.python != "auto":
        return [cfg.python]
    out: list[str] = []
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", getattr(sys, "_base_executable", None), sys.executable):
        if p and os.path.isfile(p) and os.access(p, os.X_OK) and p not in out:
            out.append(p)
    return out


def _safe_relpath(name: str) -> str:
    norm = posixpath.normpath(name)
    if not name or norm.startswith("/") or norm == "." or norm.startswith("../") or norm == "..":
        raise ValueError(f"sandbox file name must be a relative path inside the work dir: {name!r}")
    return norm


# --------------------------------------------------------------------------- the sandbox


class Sandbox:
    """Runs untrusted programs in the strongest isolation layer available (see module doc)."""

    _probe_cache: dict[tuple, ProbeResult] = {}
    _probe_lock = threading.Lock()

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.info = self.probe(self.cfg)
        self.layer = self.info.layer
        self._slots: queue.Queue[int] = queue.Queue()
        for i in range(self.cfg.max_parallel):
            self._slots.put(i)
        self._root = tempfile.mkdtemp(prefix="meshrl-sbx-", dir=self.cfg.workdir_root)
        os.chmod(self._root, 0o711)
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ----------------------------------------------------------------- probing

    @classmethod
    def probe(cls, cfg: SandboxConfig | None = None, refresh: bool = False) -> ProbeResult:
        """Find the strongest layer that works here for ``cfg`` (cached per process)."""
        cfg = cfg or SandboxConfig()
        key = (cfg.layer, cfg.python, cfg.bwrap_path, tuple(cfg.extra_ro_binds), os.geteuid(), cfg.sandbox_uid_base)
        with cls._probe_lock:
            if not refresh and key in cls._probe_cache:
                return cls._probe_cache[key]
            result = cls._probe(cfg)
            cls._probe_cache[key] = result
            log.info("sandbox probe: %s", result.describe())
            return result

    @classmethod
    def _probe(cls, cfg: SandboxConfig) -> ProbeResult:
        drop = _is_root()
        reasons: list[str] = []
        pythons = _python_candidates(cfg)
        if not pythons:
            raise SandboxUnavailable("no python interpreter found for the sandbox")
        if cfg.layer in ("auto", "bwrap"):
            bw = _resolve_bwrap(cfg.bwrap_path)
            if bw is None:
                reasons.append(f"bubblewrap not found ('{cfg.bwrap_path}'; apt-get install bubblewrap)")
            else:
                for py in pythons:
                    for disable_userns in (True, False):
                        info = ProbeResult("bwrap", py, bw, drop, disable_userns)
                        ok, why = cls._try(cfg, info)
                        if ok:
                            reason = "; ".join(reasons)
                            if not disable_userns:
                                reason = (reason + "; " if reason else "") + "bwrap --disable-userns unsupported"
                            return ProbeResult(
                                "bwrap", py, bw, drop, disable_userns, reason, _uncontained("bwrap", drop, disable_userns)
                            )
                        reasons.append(f"bwrap with {py}{'' if disable_userns else ' (no --disable-userns)'}: {why}")
            if cfg.layer == "bwrap":
                raise SandboxUnavailable("bwrap layer requested but unavailable: " + "; ".join(reasons))
        for py in pythons:
            info = ProbeResult("rlimit", py, None, drop)
            ok, why = cls._try(cfg, info)
            if ok:
                return ProbeResult("rlimit", py, None, drop, False, "; ".join(reasons), _uncontained("rlimit", drop, False))
            reasons.append(f"rlimit with {py}: {why}")
        raise SandboxUnavailable("no sandbox layer works here: " + "; ".join(reasons))

    @classmethod
    def _try(cls, cfg: SandboxConfig, info: ProbeResult) -> tuple[bool, str]:
        sb = object.__new__(cls)
        sb.cfg = cfg
        sb.info = info
        sb.layer = info.layer
        sb._root = tempfile.mkdtemp(prefix="meshrl-sbx-probe-", dir=cfg.workdir_root)
        os.chmod(sb._root, 0o711)
        sb._counter = 0
        sb._counter_lock = threading.Lock()
        try:
            r = sb._run_in_slot(
                cfg.max_parallel,  # a slot no pool uses
                {"probe.py": "import sys\nprint('ok', sys.version_info[0])\n"},
                ["python", "probe.py"],
                timeout_s=20.0,
                stdin=None,
            )
        except Exception as e:  # noqa: BLE001 -- any failure means the layer does not work
            return False, f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(sb._root, ignore_errors=True)
        if r.exit_code == 0 and r.stdout.strip() == "ok 3":
            return True, ""
        detail = (r.stderr or r.stdout).strip().splitlines()
        return False, f"exit {r.exit_code}: {detail[-1] if detail else 'no output'}"

    # ----------------------------------------------------------------- public API

    def run(
        self,
        files: Mapping[str, str | bytes],
        argv: list[str],
        timeout_s: float | None = None,
        stdin: str | bytes | None = None,
    ) -> ExecResult:
        """Run ``argv`` in a fresh work directory holding ``files``.

        ``argv[0]`` of ``python``/``python3`` means the sandbox's interpreter; any other program
        must exist inside the sandbox.
        """
        return self._run(files, argv, timeout_s, stdin, None)

    def converse(
        self,
        files: Mapping[str, str | bytes],
        argv: list[str],
        talk: Callable[[Channel], T],
        timeout_s: float | None = None,
    ) -> tuple[T, ExecResult]:
        """Run ``argv`` like ``run`` while ``talk(channel)``, on a thread of its own, holds a
        conversation with it over a ``meshrl.envs.sandbox_channel.Channel``: request lines to the
        program (``$MESHRL_CALL_FD``), its reply lines back (``$MESHRL_REPLY_FD``). When ``talk``
        returns, the program's request pipe is closed and it is killed unless it exits within a
        grace second. Returns what ``talk`` returned (None when the program could not be started;
        its exception is raised) and the execution."""
        box: dict[str, Any] = {}

        def keep(channel: Channel) -> None:
            box["value"] = talk(channel)

        res = self._run(files, argv, timeout_s, None, keep)
        return box.get("value"), res

    def _run(self, files, argv, timeout_s, stdin, talk) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox is closed")
        if not argv:
            raise ValueError("argv is empty")
        timeout = float(timeout_s if timeout_s is not None else self.cfg.timeout_s)
        slot = self._slots.get()
        try:
            return self._run_in_slot(slot, files, argv, timeout, stdin, talk)
        finally:
            self._slots.put(slot)

    def run_many(self, jobs: Iterable[SandboxJob | Mapping[str, Any]], max_parallel: int | None = None) -> list[ExecResult]:
        """Run several jobs concurrently (at most ``max_parallel``, default ``cfg.max_parallel``);
        results come back in job order."""
        items = [j if isinstance(j, SandboxJob) else SandboxJob(**j) for j in jobs]
        if not items:
            return []
        n = max(1, min(max_parallel or self.cfg.max_parallel, len(items)))
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sandbox") as pool:
            futs = [pool.submit(self.run, j.files, j.argv, j.timeout_s, j.stdin) for j in items]
            return [f.result() for f in futs]

    async def arun(
        self,
        files: Mapping[str, str | bytes],
        argv: list[str],
        timeout_s: float | None = None,
        stdin: str | bytes | None = None,
    ) -> ExecResult:
        """``run`` on the sandbox's own thread pool, awaitable without blocking the event loop."""
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.cfg.max_parallel, thread_name_prefix="sandbox-async")
        call = functools.partial(self.run, files, argv, timeout_s, stdin)
        return await loop.run_in_executor(self._executor, call)

    def close(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort: do not leave work dirs behind
        try:
            if not getattr(self, "_closed", True):
                shutil.rmtree(self._root, ignore_errors=True)
        except Exception:  # noqa: BLE001
            pass

    # ----------------------------------------------------------------- internals


    def _limits(self, timeout_s: float) -> str:
        c = self.cfg
        cpu = int(math.ceil(timeout_s)) + 1
        mem = c.memory_mb << 20
        fsize = c.max_file_mb << 20
        items = [
            ("CPU", cpu, cpu + 1),
            ("AS", mem, mem),
            ("NPROC", c.max_processes, c.max_processes),
            ("FSIZE", fsize, fsize),
            ("NOFILE", c.max_open_files, c.max_open_files),
            ("CORE", 0, 0),
            ("NICE", c.nice, c.nice),
        ]
        return ",".join(f"{n}:{s}:{h}" for n, s, h in items)

    def _env(self, home: str, tmp: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONUNBUFFERED": "1",
            "MALLOC_ARENA_MAX": "2",
        }
        env.update(self.cfg.env)
        return env

    def _inner_python(self) -> str:
        py = self.info.python
        return py if os.path.realpath(py).startswith("/usr/") else os.path.realpath(py)

    def _bwrap_argv(self, env: dict[str, str], file_fds: list[tuple[int, str]], dirs: list[str]) -> list[str]:
        c = self.cfg
        info = self.info
        a = [info.bwrap or "bwrap"]
        a += ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if info.disable_userns:
            a.append("--disable-userns")
        a += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        a += ["--uid", str(SANDBOX_INNER_ID), "--gid", str(SANDBOX_INNER_ID), "--hostname", "sandbox"]
        a.append("--clearenv")
        for k, v in env.items():
            a += ["--setenv", k, v]
        a += _runtime_binds(info.python)
        for p in c.extra_ro_binds:
            if os.path.exists(p):
                a += ["--ro-bind", p, p]
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--size", str(c.tmp_mb << 20), "--tmpfs", "/tmp"]
        a += ["--size", str(c.workdir_mb << 20), "--perms", "0700", "--tmpfs", SANDBOX_WORKDIR]
        for d in dirs:
            a += ["--dir", posixpath.join(SANDBOX_WORKDIR, d)]
        for fd, name in file_fds:
            a += ["--perms", "0644", "--file", str(fd), posixpath.join(SANDBOX_WORKDIR, name)]
        a += ["--remount-ro", "/", "--chdir", SANDBOX_WORKDIR]
        return a

    def _run_in_slot(
        self,
        slot: int,
        files: Mapping[str, str | bytes],
        argv: list[str],
        timeout_s: float,
        stdin: str | bytes | None,
        talk: Callable[[Channel], None] | None = None,
    ) -> ExecResult:
        t0 = time.monotonic()
        lease = _UidLease.acquire(self.cfg.sandbox_uid_base, sweep=self.layer == "rlimit") if self.info.drop_uid else None
        uid = gid = lease.uid if lease is not None else None
        with self._counter_lock:
            self._counter += 1
            n = self._counter
        norm_files = {_safe_relpath(k): (v.encode() if isinstance(v, str) else bytes(v)) for k, v in files.items()}
        dirs = sorted({posixpath.dirname(k) for k in norm_files if posixpath.dirname(k)})
        all_dirs: list[str] = []
        for d in dirs:  # parents first
            parts = d.split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub not in all_dirs:
                    all_dirs.append(sub)
        to_close: list[int] = []
        pass_fds: list[int] = []
        channel = Channel() if talk is not None else None
        host_dir = None
        try:
            if channel is not None:
                pass_fds += channel.child_fds()
            limits = self._limits(timeout_s)
            prog = list(argv)
            if prog[0] in ("python", "python3") and len(prog) > 1 and not prog[1].startswith("-"):
                prog[0] = "@py"  # the wrapper runs the script itself: one interpreter start, not two
            if self.layer == "bwrap":
                if prog[0] in ("python", "python3"):
                    prog[0] = self._inner_python()
                env = self._env(SANDBOX_WORKDIR, "/tmp")
                if channel is not None:
                    env.update(channel.child_env())
                file_fds = []
                for name, data in norm_files.items():
                    fd = os.memfd_create("sbxfile")
                    to_close.append(fd)
                    _write_all(fd, data)
                    os.lseek(fd, 0, os.SEEK_SET)
                    file_fds.append((fd, name))
                    pass_fds.append(fd)
                cmd = self._bwrap_argv(env, file_fds, all_dirs)
                cmd += [self._inner_python(), "-B", "-s", "-c", _WRAPPER, limits, *prog]
                popen_env = {}
                cwd = "/"
            else:
                if prog[0] in ("python", "python3"):
                    prog[0] = self.info.python
                host_dir = os.path.join(self._root, f"run-{n}")
                os.mkdir(host_dir, 0o700)
                tmp = os.path.join(host_dir, ".tmp")
                os.mkdir(tmp, 0o700)
                for d in all_dirs:
                    os.makedirs(os.path.join(host_dir, d), exist_ok=True)
                for name, data in norm_files.items():
                    with open(os.path.join(host_dir, name), "wb") as f:
                        f.write(data)
                if uid is not None:
                    for dirpath, dirnames, filenames in os.walk(host_dir):
                        os.chown(dirpath, uid, gid)
                        for fn in filenames:
                            os.chown(os.path.join(dirpath, fn), uid, gid)
                env = self._env(host_dir, tmp)
                if channel is not None:
                    env.update(channel.child_env())
                popen_env = env
                cmd = [self.info.python, "-B", "-s", "-c", _WRAPPER, limits, *prog]
                cwd = host_dir
            stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
            kw: dict[str, Any] = {}
            if uid is not None:
                kw.update(user=uid, group=gid, extra_groups=[])
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE if stdin_bytes is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=popen_env,
                    pass_fds=tuple(pass_fds),
                    close_fds=True,
                    start_new_session=True,
                    **kw,
                )
            except OSError as e:
                return ExecResult("", f"sandbox: failed to start: {e}", None, False, None,
                                  time.monotonic() - t0, self.layer, False, "sandbox_error")
            for fd, _ in (file_fds if self.layer == "bwrap" else []):
                os.close(fd)
                to_close.remove(fd)
            failure: list[BaseException] = []
            talker = None
            if channel is not None:
                channel.child_started(proc.pid)
                talker = threading.Thread(target=_talk, args=(talk, channel, failure), name="sandbox-talk", daemon=True)
                talker.start()
            try:
                res = self._communicate(proc, stdin_bytes, channel, timeout_s, uid)
            finally:
                if talker is not None:
                    channel.eof()
                    talker.join()
            if failure:
                raise failure[0]
            out, err, timed_out, truncated, output_limited, stopped, status, cpu_s = res
            wall = time.monotonic() - t0
            exit_code, sig = _decode_status(status, self.layer == "bwrap")
            err_text = err.decode("utf-8", "replace")
            exec_failed = exit_code == _EXEC_FAILED and err_text.startswith("sandbox: cannot execute")
            kind = classify(
                exit_code=exit_code,
                killed_signal=sig,
                timed_out=timed_out,
                output_limited=output_limited,
                stderr=err_text,
                exec_failed=exec_failed,
            )
            if self.layer == "bwrap" and exit_code == 1 and err_text.startswith("bwrap:"):
                kind = "sandbox_error"
            if stopped and kind == "crash":
                kind = None  # killed on the conversation's request: it says what went wrong
            return ExecResult(
                stdout=out.decode("utf-8", "replace"),
                stderr=err_text,
                exit_code=exit_code,
                timed_out=timed_out,
                killed_signal=sig,
                wall_s=wall,
                layer=self.layer,
                truncated=truncated,
                error_kind=kind,
                cpu_s=cpu_s,
                output_limited=output_limited,
                stopped=stopped,
            )
        finally:
            if channel is not None:
                channel.close()
            for fd in to_close:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if uid is not None and self.layer == "rlimit":
                _kill_uid(uid)
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)
            if lease is not None:
                lease.release()

    def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
        """Kill the whole execution: the sandbox init (its pid namespace goes with it), the
        process group, and on the rlimit layer every process of the slot uid."""
        if self.layer == "bwrap":
            children = _proc_children(proc.pid)
            for child in children:
                try:
                    os.kill(child, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            # let bwrap reap its init and exit by itself (no orphaned zombie), then make sure
            end = time.monotonic() + 0.5
            while children and time.monotonic() < end:
                try:
                    if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                        return
                except ChildProcessError:
                    return
                time.sleep(0.002)
        else:
            if uid is not None:
                _kill_uid(uid, rounds=3)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _communicate(self, proc: subprocess.Popen, stdin_bytes: bytes | None, channel: Channel | None,
                     timeout_s: float, uid: int | None):
        """Feed stdin, collect capped stdout/stderr, pass the channel's replies on, enforce the
        wall clock, the output cap and the channel's stop, and reap. The execution ends when its
        main process exits: whatever it left running is killed then (bwrap does this by tearing
        down the pid namespace)."""
        cap = self.cfg.max_output_bytes
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs: dict[int, bytearray] = {}
        caps: dict[int, int] = {}
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, "pipe")
            bufs[fd] = bytearray()
            caps[fd] = cap
        if channel is not None:
            sel.register(channel.reply_r, selectors.EVENT_READ, "pipe")
            sel.register(channel.wake_r, selectors.EVENT_READ, "wake")
        pending = memoryview(stdin_bytes or b"")
        if proc.stdin is not None:
            if pending:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
            else:
                proc.stdin.close()
        pidfd = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            pidfd = None  # old kernel: poll instead
        timed_out = truncated = output_limited = killed = stopped = False
        stop_reading_at = None  # after a kill or the main process's exit: drain briefly, then stop
        status = None
        cpu_s = None

        def reap() -> bool:
            nonlocal status, cpu_s
            if status is not None:
                return True
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if not pid:
                return False
            status = st
            cpu_s = ru.ru_utime + ru.ru_stime
            proc.returncode = os.waitstatus_to_exitcode(st)
            return True

        def kill(now: float) -> None:
            nonlocal killed, stop_reading_at
            killed = True
            self._kill(proc, uid)
            stop_reading_at = min(stop_reading_at or now + 2.0, now + 2.0)

        try:
            while True:
                pipes_open = any(k.data == "pipe" for k in sel.get_map().values())
                if not pipes_open and status is not None:
                    break
                now = time.monotonic()
                if status is None and now >= deadline and not killed:
                    timed_out = True
                    kill(now)
                elif status is None and not killed and channel is not None and channel.should_kill(now):
                    stopped = True
                    kill(now)
                elif status is None and killed and stop_reading_at is not None and now >= stop_reading_at:
                    kill(now)  # again: a fork may have raced the first kill
                if status is not None and stop_reading_at is not None and now >= stop_reading_at:
                    break  # something outside our reach holds the pipes open: stop reading
                limit = stop_reading_at if stop_reading_at is not None else deadline
                wait = max(0.0, min(limit - now, 0.5 if pidfd is not None else 0.02))
                if pidfd is None or not pipes_open:
                    wait = min(wait, 0.02)
                for key, ev in sel.select(wait):
                    fd = key.fd
                    if key.data == "exit":
                        sel.unregister(fd)
                        continue
                    if key.data == "wake":
                        channel.drain_wake()
                        continue
                    if key.data == "stdin":
                        try:
                            k = os.write(fd, pending[:65536])
                            pending = pending[k:]
                        except BlockingIOError:
                            continue
                        except OSError:
                            pending = memoryview(b"")
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(fd)
                        if channel is not None and fd == channel.reply_r:
                            channel.eof()
                        continue
                    if channel is not None and fd == channel.reply_r:
                        if not channel.feed(data) and not killed:
                            output_limited = True
                            kill(time.monotonic())
                        continue
                    buf = bufs[fd]
                    room = caps[fd] - len(buf)
                    if len(data) > room:
                        buf += data[: max(room, 0)]
                        truncated = True
                        if self.cfg.kill_on_output_limit and not killed:
                            output_limited = True
                            kill(time.monotonic())
                    else:
                        buf += data
                if status is None and reap():
                    # the main process is gone: end the execution, leftovers included
                    if self.layer == "rlimit":
                        self._kill(proc, uid)
                    now = time.monotonic()
                    stop_reading_at = min(stop_reading_at or now + 0.5, now + 0.5)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            if status is None:  # we stopped reading before the end: make sure it is dead and reaped
                self._kill(proc, uid)
                _, st, ru = os.wait4(proc.pid, 0)
                status, cpu_s = st, ru.ru_utime + ru.ru_stime
                proc.returncode = os.waitstatus_to_exitcode(st)
        return (
            bytes(bufs[out_fd]),
            bytes(bufs[err_fd]),
            timed_out,
            truncated,
            output_limited,
            stopped,
            status,
            cpu_s,
        )


def _talk(talk: Callable[[Channel], None], channel: Channel, failure: list[BaseException]) -> None:
    """The conversation's thread: run it, keep its exception for the caller, then close the channel."""
    try:
        talk(channel)
    except BaseException as e:  # noqa: BLE001 -- raised again on the caller's thread
        failure.append(e)
    finally:
        channel.finish()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _decode_status(status: int | None, via_bwrap: bool) -> tuple[int | None, int | None]:
    """(exit code, signal) of the program. bwrap reports a child killed by signal N as exit
    128+N; SIGKILL of bwrap itself (our timeout) is a real signal."""
    if status is None:
        return None, signal.SIGKILL
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    code = os.WEXITSTATUS(status)
    if via_bwrap and code > 128 and code - 128 in (
        signal.SIGKILL, signal.SIGXCPU, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS,
        signal.SIGXFSZ, signal.SIGTERM, signal.SIGILL, signal.SIGFPE,
    ):
        return None, code - 128
    return code, None


_PY_INFO = (
    "import sys, sysconfig; p = sysconfig.get_paths(); "
    "print(p['stdlib']); print(p['platstdlib']); print(sysconfig.get_config_var('MULTIARCH') or ''); "
    "print(sys.base_prefix)"
)


@functools.lru_cache(maxsize=None)
def _runtime_binds(python: str) -> tuple[str, ...]:
    """bwrap arguments that make ``python`` runnable, read-only, with nothing else of the host:
    its stdlib, the shared libraries of its multiarch directory and the loader. No other binary of
    /usr/bin (no shell, find, unzip), no site-/dist-packages."""
    real = os.path.realpath(python)
    out = subprocess.run([real, "-I", "-S", "-c", _PY_INFO], capture_output=True, text=True, timeout=30, env={})
    if out.returncode != 0:
        raise SandboxUnavailable(f"cannot query {python}: {out.stderr.strip()[-200:]}")
    stdlib, platstdlib, multiarch, prefix = (out.stdout.splitlines() + ["", "", "", ""])[:4]
    a: list[str] = []
    seen: set[str] = set()

    def bind(path: str) -> None:
        path = os.path.realpath(path)
        if path and path not in seen and os.path.exists(path) and not any(path.startswith(s + "/") for s in seen):
            seen.add(path)
            a.extend(["--ro-bind", path, path])

    if not real.startswith("/usr/"):
        bind(prefix)  # an interpreter outside /usr (pyenv, /opt): its whole installation prefix
    else:
        bind(real)
    bind(stdlib)
    bind(platstdlib)
    libdirs = [f"/usr/lib/{multiarch}"] if multiarch and os.path.isdir(f"/usr/lib/{multiarch}") else ["/usr/lib"]
    for d in libdirs + ["/usr/lib64", "/usr/lib32"]:
        if os.path.isdir(d):
            bind(d)
    # merged-/usr systems have /lib -> usr/lib; on others bind the real directories
    for top in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            a += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            bind(top)
    if os.path.islink("/bin"):
        a += ["--symlink", os.readlink("/bin"), "/bin"]
    if os.path.isfile("/etc/ld.so.cache"):
        a += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if real.startswith("/usr/") and python != real:
        a += ["--ro-bind", real, python]
    return tuple(a)


def _uncontained(layer: str, drop_uid: bool, disable_userns: bool) -> dict[str, str]:
    """Hostile cases a layer cannot contain, with the reason (see module doc)."""
    out: dict[str, str] = {}
    if layer == "bwrap":
        if not drop_uid and _is_root():  # pragma: no cover - drop_uid is always on as root
            out["fork_bomb"] = "sandbox runs as host root, which RLIMIT_NPROC does not bind"
        return out
    out["network_loopback"] = "rlimit layer has no network namespace"
    out["read_project_file"] = "rlimit layer has no private root: world-readable files are readable"
    out["import_reference"] = "rlimit layer has no private root: a world-readable checkout can be put on sys.path"
    out["disk_fill"] = "rlimit layer's work dir is on the host disk (only RLIMIT_FSIZE per file)"
    out["write_host_tmp"] = "rlimit layer shares the host /tmp, which anyone may write"
    if not drop_uid:
        why = "rlimit layer without root runs as the host user"
        out["kill_parent"] = why + ", which may signal its own processes"
        out["proc_parent_environ"] = why + ", who may read /proc/<parent>/environ"
        out["write_outside_workdir"] = why + ", who may write the user's files"
        out["escape_process_group"] = why + ": a setsid() child outlives the process-group kill"
        out["fork_bomb"] = why + ": RLIMIT_NPROC counts all the user's processes, not this sandbox's"
    return out
