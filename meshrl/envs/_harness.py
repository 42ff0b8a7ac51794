"""Test harness that runs *inside* the sandbox (shipped there as a file; stdlib only).

It reads the test spec from stdin, deletes itself from the work directory, loads the candidate's
``solution.py`` and runs each hidden test, reporting JSON lines on the side-channel fd
(``$MESHRL_SIDE_FD``), never on stdout, so the candidate's prints cannot be mistaken for results:

    {"event": "load", "ok": true}
    {"event": "load", "ok": false, "kind": ..., "error_type": ..., "error": ...}
    {"event": "test", "index": i, "passed": bool, "kind"?, "error_type"?, "error"?, "got"?}
    {"event": "done"}

Loading the code and each test run under a SIGALRM limit; after the first test that hangs, the
remaining tests are reported as timed out without running (they would most likely hang too).

Tests are either ``code`` (statements that must not raise; HumanEval's asserts) or ``call`` +
``expected`` (an expression and a Python literal): the value is compared *strictly* -- same
builtin type, recursively, floats with a tolerance -- so an object whose ``__eq__`` always answers
True does not pass.

Hardening, and its limit: the tests never exist on disk (stdin only), the harness file is unlinked
before the candidate runs, stdin is emptied, the side-channel fd number is removed from the
environment, and each test runs in a namespace built from trusted code plus only the candidate's
entry point. The candidate still shares this interpreter, so deliberately adversarial code could
introspect frames or the garbage collector to read the test in flight or write to the channel;
the sandbox contains what such code can do to the host, not what it can do to its own grade.
"""

import ast
import builtins
import io
import json
import math
import os
import signal
import sys
import traceback

MAX_TEXT = 2000


class _Timeout(BaseException):
    """Raised by SIGALRM: a test (or loading the code) ran past its limit."""


def _on_alarm(signum, frame):
    raise _Timeout()


def _same(got, exp):
    """Strict equality: ``exp`` is a literal, so every type in it is an exact builtin type."""
    if isinstance(exp, float) and type(got) in (int, float):
        if math.isnan(exp):
            return isinstance(got, float) and math.isnan(got)
        return math.isclose(got, exp, rel_tol=1e-6, abs_tol=1e-9)
    if type(got) is not type(exp):
        return False
    if type(exp) in (list, tuple):
        return len(got) == len(exp) and all(_same(g, e) for g, e in zip(got, exp))
    if type(exp) is dict:
        if len(got) != len(exp):
            return False
        for k, v in exp.items():
            if k not in got:
                return False
            if not _same(got[k], v):
                return False
        # the keys must be exactly the expected (builtin) keys
        return all(type(k) in (int, str, bool, float, tuple, type(None), bytes) for k in got)
    if type(exp) in (set, frozenset):
        return all(type(x) in (int, str, bool, float, tuple, type(None), bytes) for x in got) and got == exp
    return got == exp


def _short(text, limit=MAX_TEXT):
    text = str(text)
    return text if len(text) <= limit else text[: limit - 15] + "... [truncated]"


def _safe_repr(value):
    try:
        return _short(repr(value), 300)
    except BaseException:  # noqa: BLE001 -- hostile __repr__
        return "<unrepresentable %s>" % type(value).__name__


def _format_exc(exc, keep):
    """The traceback limited to frames of the candidate and the tests."""
    try:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if keep(f.filename)]
        lines = []
        if frames:
            lines.append("Traceback (most recent call last):\n")
            lines.extend(traceback.format_list(frames))
        lines.extend(traceback.format_exception_only(type(exc), exc))
        return _short("".join(lines))
    except BaseException:  # noqa: BLE001
        return "%s: <error formatting the exception>" % type(exc).__name__


def main():
    fd = int(os.environ.pop("MESHRL_SIDE_FD"))
    chan = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def emit(obj):
        chan.write(json.dumps(obj) + "\n")
        chan.flush()

    spec = json.loads(sys.stdin.read())
    # nothing of the spec stays reachable: stdin emptied, this file removed
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    except OSError:
        pass
    sys.stdin = io.StringIO("")
    try:
        os.unlink(os.path.abspath(__file__))
    except OSError:
        pass

    solution = spec.get("solution", "solution.py")
    entry = spec["entry_point"]
    preamble = spec.get("preamble", "")
    test_setup = spec.get("test_setup", "")
    tests = spec.get("tests", [])
    limit = float(spec.get("test_timeout", 3.0))
    del spec
    sys.argv = [solution]
    signal.signal(signal.SIGALRM, _on_alarm)

    def in_candidate(name):
        return name == solution or name.endswith("/" + solution)

    def in_tests(name):
        return in_candidate(name) or name.startswith("<test")

    with open(solution, encoding="utf-8", errors="replace") as f:
        source = f.read()

    ns = {"__name__": "solution", "__file__": os.path.abspath(solution), "__builtins__": builtins}
    if preamble:
        exec(compile(preamble, "<preamble>", "exec"), ns)
    try:
        code = compile(source, solution, "exec")
    except (SyntaxError, ValueError) as e:
        emit({"event": "load", "ok": False, "kind": "syntax_error", "error_type": type(e).__name__,
              "error": _short("".join(traceback.format_exception_only(type(e), e)))})
        return
    try:
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            exec(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        emit({"event": "load", "ok": False, "kind": "timeout", "error_type": "Timeout",
              "error": "loading the code took longer than %.1f s" % limit})
        return
    except SystemExit as e:
        if e.code not in (None, 0):
            emit({"event": "load", "ok": False, "error_type": "SystemExit",
                  "error": "the code called exit(%s) while loading" % _safe_repr(e.code)})
            return
    except BaseException as e:  # noqa: BLE001 -- anything the candidate raises
        emit({"event": "load", "ok": False, "error_type": type(e).__name__, "error_message": _short(str(e), 300),
              "error": _format_exc(e, in_candidate)})
        return
    fn = ns.get(entry)
    if not callable(fn):
        emit({"event": "load", "ok": False, "kind": "missing_entry_point", "error_type": "NameError",
              "error": "the code does not define a function named '%s'" % entry})
        return
    emit({"event": "load", "ok": True})

    tns = {"__name__": "__tests__", "__builtins__": builtins}
    if preamble:
        exec(compile(preamble, "<preamble>", "exec"), tns)
    if test_setup:
        exec(compile(test_setup, "<test setup>", "exec"), tns)
    tns[entry] = fn
    tns["candidate"] = fn

    timed_out = False
    for i, t in enumerate(tests):
        rec = {"event": "test", "index": i, "passed": False}
        name = "<test %d>" % i
        if timed_out:  # one test hung: the rest would too, so do not spend the budget on them
            rec.update(kind="timeout", error_type="Timeout", error="not run: an earlier test took too long")
            emit(rec)
            continue
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                if t.get("call") is not None:
                    got = eval(compile(t["call"], name, "eval"), tns)
                    exp = ast.literal_eval(t["expected"])
                    if _same(got, exp):
                        rec["passed"] = True
                    else:
                        rec.update(kind="test_failure", got=_safe_repr(got))
                else:
                    exec(compile(t["code"], name, "exec"), tns)
                    rec["passed"] = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            timed_out = True
            rec.update(kind="timeout", error_type="Timeout", error="the test took longer than %.1f s" % limit)
        except AssertionError as e:
            rec.update(kind="test_failure", error_type="AssertionError", error=_short(str(e), 300))
        except BaseException as e:  # noqa: BLE001
            rec.update(error_type=type(e).__name__, error_message=_short(str(e), 300), error=_format_exc(e, in_tests))
        emit(rec)
    emit({"event": "done"})


if __name__ == "__main__":
    main()
