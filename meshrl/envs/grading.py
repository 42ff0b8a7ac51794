"""Judge a candidate solution of a ``CodeTask`` with its hidden tests, where the candidate cannot reach.

``grade(task, code, sandbox)`` returns a :class:`GradeResult`: tests passed, per-test outcomes, one
``error_kind`` for the attempt and, when the attempt tampered with grading, the ``anomaly``.
``grade_many`` judges a batch concurrently (task-set validation, the oracle teacher, benchmarks).

What runs where, and why the candidate cannot decide its verdict: the grader is this module, in
the calling process; it alone holds the tests, the expected values and the verdict. The
candidate's code runs in a sandboxed worker process (``meshrl.envs._worker``, one per attempt,
reused across its tests, started by ``Sandbox.converse``) that receives only *calls* -- the
arguments -- and sends back only the *value* its function returned, as data (JSON with tags,
rebuilt into builtin types by ``_worker.decode``; never pickle, never eval). Every test runs here:
a ``call`` test evaluates its expression and compares the decoded value strictly (``same``) with
its expected literal; a ``code`` test (HumanEval's asserts) executes its statements here with
``candidate`` and the entry point's name bound to a proxy whose calls go to the worker. The worker
never holds a test, an expected value or a verdict, and its only descriptors to the host are its
two pipes; so whatever its code does in its own process -- patch json, math, builtins or the
worker, walk frames or the garbage collector, write to every descriptor, exit, signal, return an
object whose ``__eq__`` lies -- it yields at most a wrong value or a broken conversation.

Time limits: each test has ``test_timeout`` seconds of the worker's time: the wall clock while a
call to the candidate is in flight (the test's own statements here do not count), less the time
the conversation's threads -- the worker's, and the grader's two here -- spent ready to run but
waiting for a CPU, and never less than the CPU time the worker's main thread used (the kernel's
counts, read from outside the sandbox). A host busy with a generator beside the grader therefore
does not time out a correct candidate, while the candidate's own computing, sleeping and hanging
all count, and a solution too slow for the limit still fails it: the candidate can lengthen the
waits (by competing with itself for the CPU) but not shorten its own CPU time. The sandbox's
wall-clock limit (``exec_timeout``) still bounds the whole attempt.

Anomalies: what an honest worker never does -- a reply that is not data or not the answer to the
call in flight, replies nobody asked for, exiting by itself before the tests are over, lines on
its output shaped like a grading report -- grade the attempt 0 with ``error_kind``
``grading_anomaly`` and ``anomaly`` naming which (``ANOMALIES``); the code environment flags the
episode and the run counts them (``reward/grading_anomalies``).

What a test can observe of the candidate is the values it returns and the errors it raises (as
``CandidateError``, whatever their type): a test that checks an argument mutated in place, or
catches a particular exception type from the candidate, cannot pass. No bundled or HumanEval test
does either. Values cross as data only, so a function returning anything but builtin data (a
generator, an object of its own class) fails the test.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from meshrl.envs._worker import CodecError, decode, encode, format_exc
from meshrl.envs.base import ERROR_KINDS
from meshrl.envs.exec_errors import exception_kind
from meshrl.envs.sandbox import ExecResult, Sandbox
from meshrl.envs.sandbox_channel import Channel, ChannelClosed, ChannelTimeout
from meshrl.envs.tasks import CodeTask

SOLUTION_FILE = "solution.py"
WORKER_FILE = "_meshrl_worker.py"
MAX_TEXT = 2000

#: what an attempt that tampers with grading did (``GradeResult.anomaly``)
ANOMALIES: dict[str, str] = {
    "channel_tampering": "the worker's replies were not answers to the grader's calls (forged, malformed or unasked)",
    "early_exit": "the program exited by itself before the tests were over",
    "forged_report": "the program printed lines shaped like a grading report",
}


@lru_cache(maxsize=1)
def worker_source() -> str:
    return (Path(__file__).resolve().parent / "_worker.py").read_text()


@dataclass
class TestOutcome:
    __test__ = False

    index: int
    passed: bool
    kind: str | None = None
    error_type: str | None = None
    error: str | None = None
    got: str | None = None


@dataclass
class GradeResult:
    """How one attempt fared."""

    tests_passed: int
    tests_total: int
    loaded: bool
    """The code compiled, ran at top level and defined the entry point."""
    error_kind: str | None
    """None when every test passed; else what went wrong (see ``ERROR_KINDS``)."""
    error_text: str
    """The most informative error message (traceback of the load or first failing test)."""
    tests: list[TestOutcome] = field(default_factory=list)
    exec: ExecResult | None = None
    complete: bool = True
    """Every test was judged (False when the run was killed part-way)."""
    anomaly: str | None = None
    """The attempt tampered with grading (a key of ``ANOMALIES``); it is graded 0."""

    @property
    def fraction(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    @property
    def success(self) -> bool:
        return self.tests_total > 0 and self.tests_passed == self.tests_total

    @property
    def exec_ok(self) -> bool:
        """The code loaded and no test died of an error of the code's own (wrong answers are fine)."""
        if not self.loaded or not self.complete or self.anomaly:
            return False
        return all(t.passed or t.kind == "test_failure" for t in self.tests)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fraction"] = self.fraction
        d["success"] = self.success
        return d


def same(got: Any, exp: Any) -> bool:
    """Strict equality against a literal: the same builtin type, recursively (an int is accepted
    for a float), floats within a tolerance, NaN only for NaN."""
    if isinstance(exp, float) and type(got) in (int, float):
        if math.isnan(exp):
            return isinstance(got, float) and math.isnan(got)
        return math.isclose(got, exp, rel_tol=1e-6, abs_tol=1e-9)
    if type(got) is not type(exp):
        return False
    if type(exp) in (list, tuple):
        return len(got) == len(exp) and all(same(g, e) for g, e in zip(got, exp))
    if type(exp) is dict:
        return len(got) == len(exp) and all(k in got and same(got[k], v) for k, v in exp.items())
    return got == exp


class CandidateError(Exception):
    """The candidate's function raised, in its own process; the error as the worker reported it."""

    def __init__(self, reply: dict):
        self.error_type = _text(reply.get("error_type") or "Exception", 100)
        self.message = _text(reply.get("error_message") or "", 300)
        self.text = _text(reply.get("error") or self.error_type)
        self.kind = reply.get("kind") if reply.get("kind") in ERROR_KINDS else None
        super().__init__(self.text)


class _Stop(BaseException):
    """Ends the tests (the worker hung, ended or tampered); test code cannot catch it."""


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 15] + "... [truncated]"


def _in_tests(filename: str) -> bool:
    return filename.startswith("<test")


class _WorkerClock:
    """One test's time in the worker's time (the module docstring says why): the wall clock while
    a call is in flight, less the time the conversation's threads waited for a CPU meanwhile, and
    never less than the CPU time the worker's main thread used."""

    def __init__(self, channel: Channel, limit: float):
        self.channel, self.limit, self.used = channel, limit, 0.0
        self.start_call()

    def start_call(self) -> None:
        self.call = (time.monotonic(), *self.channel.times_s())

    def used_now(self) -> float:
        started, waited, ran = self.call
        now = time.monotonic()
        waited_now, ran_now = self.channel.times_s()
        return self.used + max(now - started - (waited_now - waited), ran_now - ran)

    def left(self) -> float:
        return self.limit - self.used_now()

    def end_call(self) -> None:
        self.used = self.used_now()


class _Judge:
    """One attempt's grading: the conversation with its worker (``talk``) and the verdict
    (``result``)."""

    def __init__(self, task: CodeTask, test_timeout: float, exec_timeout: float):
        self.task, self.limit, self.exec_timeout = task, test_timeout, exec_timeout
        self.channel: Channel | None = None
        self.load: dict | None = None
        self.outcomes: list[TestOutcome] = []
        self.done = self.hung = self.ended = False
        self.anomaly: str | None = None
        self.anomaly_text = ""
        self.clock: _WorkerClock | None = None

    # ---------------------------------------------------------------- the conversation
    def talk(self, channel: Channel) -> None:
        self.channel = channel
        try:
            self._run_tests()
        except _Stop:
            pass

    def _run_tests(self) -> None:
        t, channel = self.task, self.channel
        assert channel is not None
        self._parse(self._io(channel.recv, self.exec_timeout))  # the interpreter started (the sandbox's clock bounds it)
        channel.locate_program()  # before the candidate's code is loaded
        self.clock = _WorkerClock(channel, self.limit)
        self.load = self._ask({"op": "load", "solution": SOLUTION_FILE, "entry_point": t.entry_point,
                               "preamble": t.preamble})
        if not self.load["ok"]:
            return
        tns: dict[str, Any] = {"__name__": "__tests__", "__builtins__": builtins}
        if t.preamble:
            exec(compile(t.preamble, "<preamble>", "exec"), tns)
        if t.test_setup:
            exec(compile(t.test_setup, "<test setup>", "exec"), tns)

        def candidate(*args: Any, **kwargs: Any) -> Any:
            return self._call(args, kwargs)

        candidate.__name__ = t.entry_point
        tns[t.entry_point] = tns["candidate"] = candidate
        for i, test in enumerate(t.tests):
            if self.hung:  # one test hung: the rest would too, and the worker is gone
                self.outcomes.append(TestOutcome(i, False, "timeout", "Timeout", "not run: an earlier test took too long"))
                continue
            self.clock = _WorkerClock(channel, self.limit)
            self.outcomes.append(self._judge(i, test, tns))
        self.done = True

    def _judge(self, i: int, test, tns: dict) -> TestOutcome:
        name = f"<test {i}>"
        try:
            if test.call is not None:
                got = eval(compile(test.call, name, "eval"), tns)
                if same(got, ast.literal_eval(test.expected)):
                    return TestOutcome(i, True)
                return TestOutcome(i, False, "test_failure", got=_text(repr(got), 300))
            exec(compile(test.code, name, "exec"), tns)
            return TestOutcome(i, True)
        except _Stop:
            if not self.hung:
                raise
            return TestOutcome(i, False, "timeout", "Timeout", f"the test took longer than {self.limit:.1f} s")
        except AssertionError as e:
            return TestOutcome(i, False, "test_failure", "AssertionError", _text(str(e), 300))
        except CandidateError as e:
            kind = e.kind or ("test_failure" if e.error_type == "AssertionError" else exception_kind(e.error_type, e.message))
            return TestOutcome(i, False, kind, e.error_type, e.text)
        except Exception as e:  # noqa: BLE001 -- the test's own statements failed on the value returned
            return TestOutcome(i, False, exception_kind(type(e).__name__, str(e)), type(e).__name__,
                               format_exc(e, _in_tests))

    def _call(self, args: tuple, kwargs: dict) -> Any:
        try:
            request = {"op": "call", "id": secrets.token_hex(8), "args": encode(list(args)),
                       "kwargs": {k: encode(v) for k, v in kwargs.items()}}
        except CodecError as e:
            raise TypeError(f"the test's argument cannot be sent to the candidate: {e}") from None
        reply = self._ask(request)
        if reply.get("id") != request["id"]:
            self._tampered("a reply to a call it was not asked")
        if not reply["ok"]:
            raise CandidateError(reply)
        try:
            return decode(reply["value"])
        except (KeyError, CodecError, RecursionError):
            self._tampered("a value that is not data")

    def _ask(self, request: dict) -> dict:
        """Send one request and wait for its reply, within the test's time."""
        assert self.channel is not None and self.clock is not None
        self.clock.start_call()
        self._io(self.channel.send, json.dumps(request).encode(), max(self.clock.left(), 0.0))
        return self._parse(self._io(self._recv))

    def _recv(self) -> bytes:
        """The reply to the call in flight, before the test's time is used up."""
        assert self.channel is not None and self.clock is not None
        while True:
            left = self.clock.left()
            if left <= 0:
                raise ChannelTimeout("the test's time is used up")
            try:
                line = self.channel.recv(left)
            except ChannelTimeout:
                continue  # the conversation may have waited for a CPU meanwhile: count again
            self.clock.end_call()
            return line

    def _parse(self, line: bytes) -> dict:
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            self._tampered("a reply that is not JSON")
        if type(reply) is not dict or type(reply.get("ok")) is not bool:
            self._tampered("a reply that is not an answer")
        return reply

    def _io(self, op, *args):
        """A channel operation; the worker hanging (it is killed) or gone ends the tests."""
        assert self.channel is not None
        try:
            return op(*args)
        except ChannelTimeout:
            self.hung = True
            self.channel.stop()
            raise _Stop() from None
        except ChannelClosed:
            self.ended = True
            raise _Stop() from None

    def _tampered(self, what: str):
        self.anomaly, self.anomaly_text = "channel_tampering", f"the program's worker sent {what}"
        assert self.channel is not None
        self.channel.stop()
        raise _Stop()

    # ---------------------------------------------------------------- the verdict
    def result(self, res: ExecResult) -> GradeResult:
        total = len(self.task.tests)
        loaded = bool(self.load and self.load.get("ok"))
        if res.error_kind == "sandbox_error" or self.channel is None:
            return GradeResult(0, total, False, "sandbox_error", _exec_error_text(res), [], res, False)
        anomaly, text = self._anomaly(res)
        if anomaly:
            return GradeResult(0, total, loaded, "grading_anomaly", text, [], res, self.done, anomaly)
        if self.load is not None and not loaded:
            kind = self.load.get("kind")
            if kind not in ERROR_KINDS:
                kind = exception_kind(_text(self.load.get("error_type") or "", 100),
                                      _text(self.load.get("error_message") or self.load.get("error") or "", 300))
            return GradeResult(0, total, False, kind, _text(self.load.get("error") or ""), [], res, True)
        if self.load is None and self.hung:
            return GradeResult(0, total, False, "timeout", f"loading the code took longer than {self.limit:.1f} s",
                               [], res, True)
        tests = self.outcomes
        passed = sum(t.passed for t in tests)
        if not self.done:  # killed part-way (timeout, output flood, crash): the execution says why
            return GradeResult(passed, total, loaded, res.error_kind or "runtime_error", _exec_error_text(res),
                               tests, res, False)
        if passed == total:
            return GradeResult(passed, total, True, None, "", tests, res, True)
        failing = [t for t in tests if not t.passed]
        kinds = Counter(t.kind for t in failing)
        # an error of the code's own says more than a wrong answer
        non_answer = [k for k in kinds if k not in ("test_failure", None)]
        kind = max(non_answer, key=lambda k: kinds[k]) if non_answer else "test_failure"
        first = next((t for t in failing if t.kind == kind), failing[0])
        return GradeResult(passed, total, True, kind, first.error or "", tests, res, True)

    def _anomaly(self, res: ExecResult) -> tuple[str | None, str]:
        assert self.channel is not None
        if self.anomaly:
            return self.anomaly, self.anomaly_text
        if self.channel.extra_lines and not self.hung:  # a call given up on may still be answered late
            return "channel_tampering", f"the program's worker sent {self.channel.extra_lines} replies nobody asked for"
        if self.ended and res.exit_code is not None and not (res.timed_out or res.output_limited):
            return "early_exit", f"the program exited (status {res.exit_code}) before the tests were over"
        for line in (res.stdout + "\n" + res.stderr).splitlines():
            if _looks_like_report(line):
                return "forged_report", f"the program printed a line shaped like a grading report: {_text(line, 200)}"
        return None, ""


def _looks_like_report(line: str) -> bool:
    s = line.strip()
    if not (s.startswith("{") and s.endswith("}")) or len(s) > 10_000:
        return False
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and ("passed" in obj or "event" in obj or ("id" in obj and "ok" in obj))


def _exec_error_text(res: ExecResult) -> str:
    if res.error_kind == "timeout":
        return f"the program did not finish within {res.wall_s:.1f} s"
    if res.error_kind == "output_limit":
        return "the program printed more than the output limit and was stopped"
    if res.error_kind == "memory_error":
        return "the program ran out of memory"
    tail = res.stderr.strip()[-800:]
    return tail or f"the program exited with status {res.exit_code} (signal {res.killed_signal})"


def sandbox_files(code: str) -> dict[str, str]:
    """What the candidate's sandbox holds: its code and the worker (never a test or the reference)."""
    return {SOLUTION_FILE: code, WORKER_FILE: worker_source()}


def grade(
    task: CodeTask,
    code: str,
    sandbox: Sandbox,
    exec_timeout: float = 10.0,
    test_timeout: float = 3.0,
) -> GradeResult:
    """Run ``code`` against ``task``'s hidden tests: the code in ``sandbox``, the tests here."""
    judge = _Judge(task, test_timeout, exec_timeout)
    _, res = sandbox.converse(sandbox_files(code), ["python", WORKER_FILE], judge.talk, exec_timeout)
    return judge.result(res)


def grade_many(
    items: Iterable[tuple[CodeTask, str]],
    sandbox: Sandbox,
    exec_timeout: float = 10.0,
    test_timeout: float = 3.0,
    max_parallel: int | None = None,
) -> list[GradeResult]:
    """Grade several (task, code) pairs concurrently; results in input order."""
    pairs = list(items)
    if not pairs:
        return []
    n = max(1, min(max_parallel or sandbox.cfg.max_parallel, len(pairs)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="grade") as pool:
        return list(pool.map(lambda p: grade(p[0], p[1], sandbox, exec_timeout, test_timeout), pairs))
