"""Judge a candidate solution of a ``CodeTask`` in the sandbox with its hidden tests.

``grade(task, code, sandbox)`` runs the in-sandbox harness (``meshrl.envs._harness``) and turns
its side-channel report plus the execution result into a :class:`GradeResult`: tests passed,
per-test outcomes, and one ``error_kind`` for the attempt. ``grade_many`` judges a batch
concurrently (the single-turn reward function, and task-set validation).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from meshrl.envs.exec_errors import exception_kind
from meshrl.envs.sandbox import ExecResult, Sandbox, SandboxJob
from meshrl.envs.tasks import CodeTask

SOLUTION_FILE = "solution.py"
HARNESS_FILE = "_meshrl_harness.py"


@lru_cache(maxsize=1)
def harness_source() -> str:
    return (Path(__file__).resolve().parent / "_harness.py").read_text()


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
    """The harness reported every test (False when the run was killed part-way)."""

    @property
    def fraction(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    @property
    def success(self) -> bool:
        return self.tests_total > 0 and self.tests_passed == self.tests_total

    @property
    def exec_ok(self) -> bool:
        """The code loaded and no test died of an error of the code's own (wrong answers are fine)."""
        if not self.loaded or not self.complete:
            return False
        return all(t.passed or t.kind == "test_failure" for t in self.tests)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fraction"] = self.fraction
        d["success"] = self.success
        return d


def job_for(task: CodeTask, code: str, exec_timeout: float, test_timeout: float) -> SandboxJob:
    """The sandbox job that grades ``code`` against ``task`` (the reference is never included)."""
    spec = task.harness_spec(test_timeout, SOLUTION_FILE)
    return SandboxJob(
        files={SOLUTION_FILE: code, HARNESS_FILE: harness_source()},
        argv=["python", HARNESS_FILE],
        timeout_s=exec_timeout,
        stdin=json.dumps(spec),
        side_channel=True,
    )


def parse(task: CodeTask, res: ExecResult) -> GradeResult:
    """Combine the harness's report with how the execution ended."""
    events = []
    for line in res.side_channel.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "event" in obj:
            events.append(obj)
    total = len(task.tests)
    load = next((e for e in events if e["event"] == "load"), None)
    outcomes: dict[int, TestOutcome] = {}
    for e in events:
        if e["event"] == "test" and isinstance(e.get("index"), int) and 0 <= e["index"] < total:
            kind = e.get("kind")
            if not e.get("passed") and kind is None:
                kind = exception_kind(e.get("error_type") or "", e.get("error_message") or e.get("error") or "")
            outcomes[e["index"]] = TestOutcome(
                e["index"], bool(e.get("passed")), kind, e.get("error_type"), e.get("error"), e.get("got")
            )
    done = any(e["event"] == "done" for e in events)
    tests = [outcomes[i] for i in sorted(outcomes)]
    passed = sum(t.passed for t in tests)
    loaded = bool(load and load.get("ok"))

    if load is not None and not load.get("ok"):
        kind = load.get("kind") or exception_kind(load.get("error_type") or "", load.get("error_message") or load.get("error") or "")
        return GradeResult(0, total, False, kind, load.get("error") or "", [], res, True)
    if not done:
        # killed part-way (timeout, output flood, crash, os._exit): the execution says why
        kind = res.error_kind or ("runtime_error" if res.exit_code not in (0, None) else "runtime_error")
        if load is None and res.error_kind is None:
            kind = "runtime_error"
        text = _exec_error_text(res)
        return GradeResult(passed, total, loaded, kind, text, tests, res, False)
    if passed == total:
        return GradeResult(passed, total, True, None, "", tests, res, True)
    failing = [t for t in tests if not t.passed]
    kinds = Counter(t.kind for t in failing)
    # an error of the code's own says more than a wrong answer
    non_answer = [k for k in kinds if k not in ("test_failure", None)]
    kind = max(non_answer, key=lambda k: kinds[k]) if non_answer else "test_failure"
    first = next((t for t in failing if t.kind == kind), failing[0])
    return GradeResult(passed, total, True, kind, first.error or "", tests, res, True)


def _exec_error_text(res: ExecResult) -> str:
    if res.error_kind == "timeout":
        return f"the program did not finish within {res.wall_s:.1f} s"
    if res.error_kind == "output_limit":
        return "the program printed more than the output limit and was stopped"
    if res.error_kind == "memory_error":
        return "the program ran out of memory"
    tail = res.stderr.strip()[-800:]
    return tail or f"the program exited with status {res.exit_code} (signal {res.killed_signal})"


def grade(
    task: CodeTask,
    code: str,
    sandbox: Sandbox,
    exec_timeout: float = 10.0,
    test_timeout: float = 3.0,
) -> GradeResult:
    """Run ``code`` against ``task``'s hidden tests in ``sandbox``."""
    job = job_for(task, code, exec_timeout, test_timeout)
    res = sandbox.run(job.files, job.argv, job.timeout_s, job.stdin, side_channel=True)
    return parse(task, res)


def grade_many(
    items: Iterable[tuple[CodeTask, str]],
    sandbox: Sandbox,
    exec_timeout: float = 10.0,
    test_timeout: float = 3.0,
    max_parallel: int | None = None,
) -> list[GradeResult]:
    """Grade several (task, code) pairs concurrently; results in input order."""
    pairs = list(items)
    jobs = [job_for(t, c, exec_timeout, test_timeout) for t, c in pairs]
    results = sandbox.run_many(jobs, max_parallel=max_parallel)
    return [parse(t, r) for (t, _), r in zip(pairs, results)]
