"""The task sets: bundled meshrl tasks and HumanEval, validated against their references in the
sandbox; the tests discriminate; the strict comparison resists __eq__ tricks; references and
expected values never reach the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from meshrl.envs.grading import grade, grade_many, sandbox_files
from meshrl.envs.humaneval import load_humaneval, split_check
from meshrl.config.env import SandboxConfig
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.sandbox_channel import Channel
from meshrl.envs.tasks import CODE_TASKS_FILE, CodeTask, TestCase, load_code_tasks, task_by_id


@pytest.fixture(scope="module")
def sb():
    s = Sandbox()
    yield s
    s.close()


def test_bundled_set_shape():
    tasks = load_code_tasks("all")
    assert len(tasks) >= 40
    ids = [t.task_id for t in tasks]
    assert len(set(ids)) == len(ids)
    by_diff = Counter(t.difficulty for t in tasks)
    assert set(by_diff) == {1, 2, 3} and min(by_diff.values()) >= 10
    train, test = load_code_tasks("train"), load_code_tasks("test")
    assert len(train) + len(test) == len(tasks) and not {t.task_id for t in train} & {t.task_id for t in test}
    assert {t.difficulty for t in test} == {1, 2, 3}
    for t in tasks:
        assert t.source == "meshrl" and t.reference and len(t.tests) >= 4
        assert f"def {t.entry_point}(" in t.prompt
        assert t.reference not in t.prompt
        assert all(tc.call is not None and tc.call.startswith(t.entry_point + "(") for tc in t.tests)


def test_filters_and_lookup():
    easy = load_code_tasks("all", difficulty=1)
    assert easy and all(t.difficulty == 1 for t in easy)
    assert {t.difficulty for t in load_code_tasks("all", difficulty=[2, 3])} == {2, 3}
    assert len(load_code_tasks("train", limit=3)) == 3
    assert task_by_id("meshrl/factorial").entry_point == "factorial"
    assert task_by_id("HumanEval/0").entry_point == "has_close_elements"
    with pytest.raises(ValueError):
        load_code_tasks("valid")
    with pytest.raises(KeyError):
        task_by_id("meshrl/nope")


def test_every_reference_passes_its_hidden_tests(sb):
    tasks = load_code_tasks("all")
    results = grade_many([(t, t.reference) for t in tasks], sb)
    bad = [(t.task_id, r.error_kind, r.error_text[:200]) for t, r in zip(tasks, results) if not r.success]
    assert not bad
    assert all(r.exec.layer == sb.layer for r in results)


def test_the_tests_discriminate(sb):
    """A do-nothing stub and a constant-returning stub fail at least one test of every task."""
    tasks = load_code_tasks("all")
    items = []
    for t in tasks:
        items.append((t, f"def {t.entry_point}(*args, **kwargs):\n    return None\n"))
        items.append((t, f"def {t.entry_point}(*args, **kwargs):\n    return 0\n"))
    results = grade_many(items, sb)
    weak = [t.task_id for (t, _), r in zip(items, results) if r.success]
    assert not weak


def test_eq_override_does_not_pass(sb):
    t = task_by_id("meshrl/factorial")
    hack = (
        "class Anything:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __hash__(self):\n        return 0\n"
        "class Int(int):\n"
        "    def __eq__(self, other):\n        return True\n"
        "def factorial(n):\n    return Anything() if n % 2 else Int(0)\n"
    )
    r = grade(t, hack, sb)
    assert r.tests_passed == 0 and r.error_kind == "test_failure"


def test_floats_compare_with_tolerance_and_ints_accepted(sb):
    t = task_by_id("meshrl/celsius_to_fahrenheit")
    assert grade(t, "def celsius_to_fahrenheit(c):\n    return 32 + c * 1.8\n", sb).success
    r = grade(t, "def celsius_to_fahrenheit(c):\n    return round(c * 9 / 5 + 32)\n", sb)
    assert not r.success and r.tests_passed >= 3


def test_reference_never_shipped():
    t = task_by_id("meshrl/edit_distance")
    blob = json.dumps(sandbox_files("def edit_distance(a, b):\n    return 0\n"))
    assert t.reference.strip().splitlines()[1] not in blob


def test_humaneval_loads_and_splits():
    he = load_humaneval()
    assert len(he) == 164
    assert len(load_humaneval(limit=5)) == 5
    t = he[0]
    assert t.task_id == "HumanEval/0" and t.source == "humaneval" and t.difficulty is None
    assert "from typing import List" in t.preamble and "def has_close_elements" not in t.preamble
    assert len(t.tests) == 7 and all(tc.code and "assert" in tc.code for tc in t.tests)
    assert all("assert True" not in tc.code for x in he for tc in x.tests)
    setup, tests = split_check("METADATA = {}\n\ndef check(candidate):\n    import math\n    x = 2\n    assert candidate(x) == 4\n    for i in range(3):\n        assert candidate(i) == 2 * i\n    assert True\n")
    assert setup == "METADATA = {}"
    assert tests == ["import math\nx = 2\nassert candidate(x) == 4", "for i in range(3):\n    assert candidate(i) == 2 * i"]


@pytest.mark.slow  # ~12 s: 164 gradings on 2 cores
def test_humaneval_references_pass_and_stubs_fail(sb):
    he = load_humaneval()
    # Generous limits: this checks the references' correctness, not their speed. HumanEval/32's
    # test makes 100 calls into the sandbox, each a round trip to a niced process, and on a loaded
    # 2-core machine those add up past the 3 s per-test default.
    refs = grade_many([(t, t.reference) for t in he], sb, exec_timeout=120.0, test_timeout=60.0)
    assert [(t.task_id, r.error_kind, r.error_text[:200]) for t, r in zip(he, refs) if not r.success] == []
    sample = he[::8]
    stubs = grade_many([(t, f"def {t.entry_point}(*a, **k):\n    return None\n") for t in sample], sb)
    assert sum(r.success for r in stubs) == 0


def test_humaneval_helpers_come_from_the_prompt_not_the_candidate(sb):
    """HumanEval/32's test calls the prompt's poly(); a candidate redefining poly cannot cheat."""
    t = task_by_id("HumanEval/32")
    cheat = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 123.0\n"
    r = grade(t, cheat, sb)
    assert not r.success


def test_task_roundtrip_and_validation():
    t = load_code_tasks("all")[0]
    assert CodeTask.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert "reference" not in t.to_dict(with_reference=False)
    with pytest.raises(ValueError):
        TestCase(call="f(1)")
    with pytest.raises(ValueError):
        CodeTask("x", "p", "f", tests=())
    with pytest.raises(ValueError):
        CodeTask("x", "p", "f", tests=("assert f() == 1",), difficulty=5)
    assert CODE_TASKS_FILE.is_file()


BUSY_FOR_AT_MOST_2_MIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


def _burning(cpu_s: float) -> str:
    """A correct celsius_to_fahrenheit that first computes for ``cpu_s`` of its own CPU time."""
    return ("import time\n\ndef celsius_to_fahrenheit(c):\n    end = time.process_time() + %r\n"
            "    while time.process_time() < end:\n        pass\n    return c * 9 / 5 + 32\n" % cpu_s)


@pytest.mark.slow  # ~11 s on 2 cores
def test_a_host_too_busy_to_run_the_worker_does_not_time_out_a_correct_candidate(monkeypatch):
    """The grader, its worker and six busy processes share one core, each getting a seventh of it:
    a candidate computing 0.05 s per call is then in flight for up to about 0.35 s, past the test's
    0.2 s limit, and fails when the kernel's count of the time spent waiting for the CPU is left out. Its
    own time is within the limit, and that is what the limit counts; a candidate needing 0.3 s of
    its own still fails it."""
    t, limit = task_by_id("meshrl/celsius_to_fahrenheit"), 0.2
    sandbox = Sandbox(SandboxConfig(nice=0))  # the worker on equal terms with the busy processes
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread; the sandbox and the busy loops inherit it
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_FOR_AT_MOST_2_MIN], start_new_session=True)
            for _ in range(6)]
    try:
        time.sleep(0.3)
        with monkeypatch.context() as m:
            m.setattr(Channel, "times_s", lambda self, counted=Channel.times_s: (0.0, counted(self)[1]))
            unforgiven = grade(t, _burning(0.05), sandbox, exec_timeout=60.0, test_timeout=limit)
        correct = grade(t, _burning(0.05), sandbox, exec_timeout=60.0, test_timeout=limit)
        too_slow = grade(t, _burning(0.3), sandbox, exec_timeout=60.0, test_timeout=limit)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, allowed)
        sandbox.close()
    assert not unforgiven.success and unforgiven.error_kind == "timeout", unforgiven.tests
    assert correct.success, correct.tests
    assert not too_slow.success and too_slow.tests[0].kind == "timeout", too_slow.tests


def test_a_candidate_that_sleeps_or_spins_times_out_at_the_tests_limit(sb):
    """Sleeping and spinning are the candidate's own time: each ends the test at its limit, long
    before the attempt's wall-clock limit."""
    t = task_by_id("meshrl/celsius_to_fahrenheit")
    for body in ("time.sleep(30)", "while True:\n        pass"):
        r = grade(t, f"import time\ndef celsius_to_fahrenheit(c):\n    {body}\n", sb, exec_timeout=30.0, test_timeout=0.5)
        assert r.tests[0].kind == "timeout" and not r.success, body
        assert r.exec.wall_s < 10.0, body
