"""Sandbox API: probe, run, files, stdin, conversations, limits, classification, concurrency."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from pydantic import ValidationError

from meshrl.config.env import EnvConfig, SandboxConfig
from meshrl.envs.exec_errors import classify, exception_kind, last_exceptions
from meshrl.envs.sandbox import (
    HOSTILE_CASES,
    ExecResult,
    Sandbox,
    SandboxJob,
    SandboxUnavailable,
)
from meshrl.envs.sandbox_channel import ChannelClosed, ChannelTimeout


@pytest.fixture(scope="module")
def sb():
    s = Sandbox(SandboxConfig(timeout_s=5.0))
    yield s
    s.close()


def test_probe_reports_a_layer():
    info = Sandbox.probe()
    print(f"\n[sandbox] {info.describe()}")
    assert info.layer in ("bwrap", "rlimit")
    assert os.path.isfile(info.python)
    for case in info.uncontained:
        assert case in HOSTILE_CASES
    # the fallback is always there and always explains its gaps
    weak = Sandbox.probe(SandboxConfig(layer="rlimit"))
    assert weak.layer == "rlimit" and weak.uncontained and "network_loopback" in weak.uncontained


def test_bwrap_requested_but_missing_fails_loudly():
    with pytest.raises(SandboxUnavailable, match="bubblewrap not found"):
        Sandbox.probe(SandboxConfig(layer="bwrap", bwrap_path="/nonexistent/bwrap"), refresh=True)


def test_auto_falls_back_when_bwrap_missing():
    s = Sandbox(SandboxConfig(bwrap_path="/nonexistent/bwrap"))
    try:
        assert s.layer == "rlimit" and "bubblewrap not found" in s.info.reason
        r = s.run({"a.py": "print(6 * 7)"}, ["python", "a.py"], timeout_s=5)
        assert r.stdout == "42\n" and r.layer == "rlimit"
    finally:
        s.close()


def test_run_basic(sb):
    r = sb.run({"main.py": "import sys\nprint('out')\nprint('err', file=sys.stderr)\n"}, ["python", "main.py"])
    assert isinstance(r, ExecResult)
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.killed_signal) == ("out\n", "err\n", 0, False, None)
    assert r.error_kind is None and r.ok and not r.truncated and r.layer == sb.layer
    assert 0 < r.wall_s < 5 and r.cpu_s is not None
    assert r.to_dict()["stdout"] == "out\n"


def test_files_in_subdirectories_and_argv(sb):
    files = {
        "main.py": "import sys\nfrom pkg.util import twice\nprint(twice(int(sys.argv[1])), open('data/x.txt').read())\n",
        "pkg/__init__.py": "",
        "pkg/util.py": "def twice(x):\n    return 2 * x\n",
        "data/x.txt": "hello",
    }
    r = sb.run(files, ["python", "main.py", "21"])
    assert r.stdout == "42 hello\n", r.stderr


def test_bytes_files_and_stdin(sb):
    r = sb.run({"a.py": b"import sys\nprint(sys.stdin.read().upper())\n"}, ["python", "a.py"], stdin="shout " * 20000)
    assert r.stdout.startswith("SHOUT SHOUT") and r.truncated  # 120 kB of output > 64 kB cap
    r = sb.run({"a.py": "print(input())"}, ["python", "a.py"])  # no stdin: EOF, not a hang
    assert r.error_kind == "runtime_error" and "EOFError" in r.stderr


def test_bad_file_names_rejected(sb):
    for name in ("../escape.py", "/etc/x", "", "."):
        with pytest.raises(ValueError):
            sb.run({name: "x"}, ["python", "-c", "pass"])


_ECHO = (
    "import os\n"
    "req = os.fdopen(int(os.environ['MESHRL_CALL_FD']), 'rb')\n"
    "rep = os.fdopen(int(os.environ['MESHRL_REPLY_FD']), 'wb', buffering=0)\n"
    "print('visible')\n"
    "for line in req:\n"
    "    rep.write(line.upper())\n"
)


def test_converse(sb):
    """The host's request lines reach the program and its reply lines come back, apart from its
    output; the end of the conversation closes its requests and it exits by itself."""
    def talk(ch):
        out = []
        for word in (b"a", b"bc" * 50000):
            ch.send(word, 2.0)
            out.append(ch.recv(2.0))
        return out

    value, r = sb.converse({"a.py": _ECHO}, ["python", "a.py"], talk, timeout_s=5)
    assert value == [b"A", b"BC" * 50000] and r.stdout == "visible\n"
    assert r.exit_code == 0 and not r.stopped and r.error_kind is None
    r = sb.run({"a.py": "import os\nprint(os.environ.get('MESHRL_CALL_FD'))"}, ["python", "a.py"])
    assert r.stdout == "None\n"


_BURN = (
    "import os, time\n"
    "req = os.fdopen(int(os.environ['MESHRL_CALL_FD']), 'rb')\n"
    "rep = os.fdopen(int(os.environ['MESHRL_REPLY_FD']), 'wb', buffering=0)\n"
    "for line in req:\n"
    "    end = time.process_time() + float(line)\n"
    "    while time.process_time() < end:\n"
    "        pass\n"
    "    rep.write(b'done\\n')\n"
)


def test_the_programs_cpu_time_is_its_own_and_counted_once_located(sb):
    """``times_s`` gives the program's CPU seconds only once ``locate_program`` found it (0.0
    before), and they are the program's: 0.4 s burnt by it show as 0.3-2.0 s (the conversation's
    own threads, which only wait meanwhile, would show next to nothing)."""
    def talk(ch):
        ch.send(b"0.01", 5.0)
        assert ch.recv(5.0) == b"done"
        unlocated = ch.times_s()[1]
        ch.locate_program()
        _, before = ch.times_s()
        ch.send(b"0.4", 5.0)
        assert ch.recv(10.0) == b"done"
        _, after = ch.times_s()
        return unlocated, before, after

    (unlocated, before, after), r = sb.converse({"a.py": _BURN}, ["python", "a.py"], talk, timeout_s=20)
    assert r.exit_code == 0, r.stderr
    assert unlocated == 0.0 and before > 0.0
    assert 0.3 <= after - before < 2.0


def test_converse_silent_dead_and_stubborn_programs(sb):
    """A program that does not answer times the conversation out, one that exits closes it, and
    one still running when the conversation is over is killed within the grace."""
    def ask(ch):
        ch.send(b"x", 1.0)
        with pytest.raises(ChannelTimeout):
            ch.recv(0.3)
        return "gave up"

    t = time.monotonic()
    value, r = sb.converse({"a.py": "import time\ntime.sleep(30)\n"}, ["python", "a.py"], ask, timeout_s=20)
    assert value == "gave up" and r.stopped and not r.timed_out and time.monotonic() - t < 5

    def wait_end(ch):
        with pytest.raises(ChannelClosed):
            ch.recv(5.0)
        with pytest.raises(ChannelClosed):  # and it stays closed
            ch.recv(5.0)
        return "closed"

    value, r = sb.converse({"a.py": "print(1)"}, ["python", "a.py"], wait_end, timeout_s=5)
    assert value == "closed" and r.exit_code == 0 and not r.stopped

    def boom(ch):
        raise KeyError("the conversation's own error")

    with pytest.raises(KeyError):
        sb.converse({"a.py": _ECHO}, ["python", "a.py"], boom, timeout_s=5)


def test_minimal_environment(sb):
    r = sb.run({"a.py": "import os\nprint(sorted(os.environ))"}, ["python", "a.py"])
    names = eval(r.stdout)
    assert "PATH" in names and "HOME" in names
    assert not [n for n in names if "KEY" in n or "TOKEN" in n or n.startswith(("HF_", "VIRTUAL_ENV", "MESHRL"))]


def test_extra_env_and_limits_are_applied():
    s = Sandbox(SandboxConfig(env={"GREETING": "hi"}, memory_mb=256, max_processes=8, max_open_files=32, max_file_mb=2))
    try:
        code = (
            "import os, resource as r\n"
            "print(os.environ['GREETING'], os.nice(0))\n"
            "for n in ('AS', 'NPROC', 'NOFILE', 'FSIZE', 'CPU', 'CORE'):\n"
            "    print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n)))\n"
        )
        r = s.run({"a.py": code}, ["python", "a.py"], timeout_s=3)
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines()[1:])
        assert r.stdout.startswith("hi 10\n")
        assert lines["AS"] == f"({256 << 20}, {256 << 20})"
        assert lines["NPROC"] == "(8, 8)" and lines["NOFILE"] == "(32, 32)"
        assert lines["FSIZE"] == f"({2 << 20}, {2 << 20})" and lines["CPU"] == "(4, 5)" and lines["CORE"] == "(0, 0)"
    finally:
        s.close()


def test_bwrap_view_of_the_filesystem(sb):
    if sb.layer != "bwrap":
        pytest.skip(f"layer is {sb.layer}: {sb.info.reason}")
    code = (
        "import os, sys\n"
        "print(sorted(os.listdir('/')))\n"
        "print(os.getcwd(), os.getuid(), sys.executable)\n"
        "print([p for p in ('/root', '/home', '/etc/shadow', '/etc/passwd', '/work/main', '/usr/bin/sh') if os.path.exists(p)])\n"
        "print(os.access('/usr', os.W_OK), os.access('/work', os.W_OK), os.access('/tmp', os.W_OK))\n"
    )
    r = sb.run({"a.py": code}, ["python", "a.py"])
    top, where, present, writable = r.stdout.splitlines()
    assert set(eval(top)) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "proc", "tmp", "usr", "work"}
    assert where.startswith("/work 1000 ")
    assert eval(present) == []
    assert writable == "False True True"


def test_exit_codes_and_signals(sb):
    r = sb.run({"a.py": "raise SystemExit(3)"}, ["python", "a.py"])
    assert (r.exit_code, r.killed_signal, r.error_kind) == (3, None, "runtime_error")
    r = sb.run({"a.py": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"}, ["python", "a.py"])
    assert (r.exit_code, r.killed_signal, r.error_kind) == (None, signal.SIGSEGV, "crash")


@pytest.mark.parametrize(
    "code,kind",
    [
        ("def f(:\n", "syntax_error"),
        ("if True:\nprint(1)\n", "syntax_error"),
        ("import numpy_not_here\n", "import_error"),
        ("1/0\n", "runtime_error"),
        ("open('/nope/x')\n", "file_not_found"),
        ("raise MemoryError\n", "memory_error"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n", "network_error"),
        ("print('fine')\n", None),
    ],
)
def test_error_kinds(sb, code, kind):
    r = sb.run({"main.py": code}, ["python", "main.py"])
    assert r.error_kind == kind, (r.error_kind, r.stderr[-300:])


def test_missing_program_is_tool_not_found(sb):
    r = sb.run({"a.txt": ""}, ["/usr/bin/definitely-not-here"])
    assert r.error_kind == "tool_not_found" and r.exit_code == 127


def test_output_drained_when_not_killing():
    s = Sandbox(SandboxConfig(kill_on_output_limit=False, max_output_bytes=4096))
    try:
        r = s.run({"a.py": "for i in range(20000):\n    print(i)\nprint('end')\n"}, ["python", "a.py"], timeout_s=10)
        assert r.exit_code == 0 and r.truncated and not r.output_limited and r.error_kind is None
        assert len(r.stdout) <= 4096
    finally:
        s.close()


def test_run_many_16_concurrent_correct(sb):
    jobs = [
        SandboxJob({"a.py": f"import time\ntime.sleep(0.2)\nprint({i} * {i})\n"}, ["python", "a.py"], timeout_s=20)
        for i in range(16)
    ]
    t = time.monotonic()
    results = sb.run_many(jobs, max_parallel=16)
    wall = time.monotonic() - t
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(16)]
    assert all(r.error_kind is None for r in results)
    assert wall < 16 * 0.2  # they overlapped


def test_run_many_accepts_dicts_and_isolates_runs(sb):
    # every run gets a fresh work dir: a file written by one is not seen by another
    jobs = [{"files": {"a.py": "import os\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')\n"}, "argv": ["python", "a.py"]}] * 4
    for r in sb.run_many(jobs, max_parallel=2):
        assert r.stdout == "['a.py']\n"


def test_arun_does_not_block_the_event_loop(sb):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        res = await asyncio.gather(*[sb.arun({"a.py": "import time\ntime.sleep(0.3)\nprint('ok')"}, ["python", "a.py"]) for _ in range(4)])
        t.cancel()
        return res, ticks

    res, ticks = asyncio.run(main())
    assert all(r.stdout == "ok\n" for r in res)
    assert ticks >= 10


def test_slots_bound_parallelism():
    s = Sandbox(SandboxConfig(max_parallel=2))
    try:
        t = time.monotonic()
        res = s.run_many([SandboxJob({"a.py": "import time; time.sleep(0.3)"}, ["python", "a.py"])] * 4, max_parallel=4)
        assert all(r.ok for r in res)
        assert time.monotonic() - t >= 0.55  # 4 jobs through 2 slots: at least two rounds
    finally:
        s.close()


def test_closed_sandbox_refuses(sb):
    s = Sandbox()
    root = s._root
    s.close()
    assert not os.path.exists(root)
    with pytest.raises(RuntimeError):
        s.run({"a.py": ""}, ["python", "a.py"])


def test_classifier_units():
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nZeroDivisionError: division by zero\n'
    assert last_exceptions(tb) == [("ZeroDivisionError", "division by zero")]
    assert last_exceptions("hello: world\nError: not an exception line\n") == []
    assert exception_kind("OSError", "[Errno 30] Read-only file system: '/x'") == "permission_denied"
    assert exception_kind("OSError", "[Errno 28] No space left on device") == "resource_limit"
    assert exception_kind("socket.gaierror", "[Errno -3]") == "network_error"
    assert exception_kind("KeyError", "'x'") == "runtime_error"
    base = dict(exit_code=None, killed_signal=signal.SIGKILL, stderr="")
    assert classify(timed_out=True, output_limited=False, **base) == "timeout"
    assert classify(timed_out=False, output_limited=True, **base) == "output_limit"
    bomb = "Traceback (most recent call last):\n  File \"m.py\", line 3\nBlockingIOError: [Errno 11] Resource temporarily unavailable\n"
    assert classify(timed_out=True, output_limited=True, exit_code=None, killed_signal=9, stderr=bomb) == "resource_limit"
    assert classify(timed_out=False, output_limited=False, exit_code=0, killed_signal=None, stderr="") is None


def test_config_section():
    cfg = EnvConfig.model_validate({"sandbox": {"memory_mb": 512}, "code": {"max_turns": 2}})
    assert cfg.sandbox.memory_mb == 512 and cfg.code.max_turns == 2
    with pytest.raises(ValidationError):
        SandboxConfig(unknown_key=1)
    with pytest.raises(ValidationError):
        SandboxConfig(extra_ro_binds=["relative/path"])
    with pytest.raises(ValidationError):
        SandboxConfig(layer="docker")
    for name, field in SandboxConfig.model_fields.items():
        assert field.description, f"SandboxConfig.{name} has no docstring"


def test_uid_leases_are_exclusive_across_sandboxes():
    """Two Sandbox instances (or processes) never run code under the same uid at the same time, so
    one run's cleanup cannot kill the other's processes."""
    if os.geteuid() != 0:
        pytest.skip("uid leasing is used only when the host is root")
    a, b = Sandbox(SandboxConfig(layer="rlimit")), Sandbox(SandboxConfig(layer="rlimit"))
    try:
        code = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(0.5)\n"
        jobs = [SandboxJob({"a.py": code}, ["python", "a.py"], timeout_s=10)] * 3
        import threading

        out: list = []
        ts = [threading.Thread(target=lambda s=s: out.extend(s.run_many(jobs))) for s in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert all(r.ok for r in out), [r.stderr for r in out]
        uids = [int(r.stdout) for r in out]
        assert len(set(uids)) == 6 and all(u >= a.cfg.sandbox_uid_base for u in uids)
    finally:
        a.close()
        b.close()
