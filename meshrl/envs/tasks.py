"""Code tasks: the common ``CodeTask`` type and meshrl's bundled function-writing task set.

The bundled set (``data/code_tasks.jsonl``, written for this project) has small function-writing
problems graded by difficulty (1 easy .. 3 hard), each with hidden tests and a reference solution.
Its easy tier (``data/code_tasks_easy.jsonl``, `task_source: meshrl_easy`, written by
``scripts/make_easy_code_tasks.py``) has one-line functions in the same format. The reference is
used to validate the task sets in the test-suite and by the oracle teacher
(``meshrl.teachers.oracle``, a stand-in for a stronger model in trace replay); it is never put in
a prompt, in the policy's sandbox, or anywhere the policy's code can reach.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

DATA_DIR = Path(__file__).resolve().parent / "data"
CODE_TASKS_FILE = DATA_DIR / "code_tasks.jsonl"
EASY_CODE_TASKS_FILE = DATA_DIR / "code_tasks_easy.jsonl"
BUNDLED_FILES = {"meshrl": CODE_TASKS_FILE, "meshrl_easy": EASY_CODE_TASKS_FILE}
"""The file of each bundled `task_source`."""
SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class TestCase:
    """One hidden test: ``call`` + ``expected`` (the value must equal the literal, strictly) or
    ``code`` (statements that must run without raising, e.g. asserts)."""

    __test__ = False  # not a pytest class

    call: str | None = None
    expected: str | None = None
    code: str | None = None

    def __post_init__(self):
        if (self.call is None) == (self.code is None):
            raise ValueError("a test has either call+expected or code")
        if self.call is not None and self.expected is None:
            raise ValueError(f"test '{self.call}' has no expected value")

    def to_spec(self) -> dict[str, str]:
        if self.call is not None:
            return {"call": self.call, "expected": self.expected}
        return {"code": self.code}

    def describe(self) -> str:
        """How the test reads to a person (shown only when failed tests are revealed)."""
        if self.call is not None:
            return f"{self.call} == {self.expected}"
        return (self.code or "").strip()

    @classmethod
    def from_obj(cls, obj: Any) -> "TestCase":
        if isinstance(obj, TestCase):
            return obj
        if isinstance(obj, str):
            return cls(code=obj)
        return cls(call=obj.get("call"), expected=obj.get("expected"), code=obj.get("code"))


@dataclass(frozen=True)
class CodeTask:
    """A function-writing task: what the policy is asked, and how its code is judged."""

    task_id: str
    prompt: str
    """Problem statement shown to the policy (signature, description, examples)."""
    entry_point: str
    """Name of the function the code must define."""
    tests: tuple[TestCase, ...]
    """Hidden tests."""
    difficulty: int | None = None
    """1 (easy) .. 3 (hard); None when unknown (HumanEval)."""
    split: str = "train"
    source: str = "meshrl"
    preamble: str = ""
    """Trusted code run before the candidate (and in the tests' namespace): imports and helper
    functions the prompt already provides."""
    test_setup: str = ""
    """Trusted code run in the tests' namespace before the tests."""
    reference: str | None = field(default=None, repr=False)
    """A correct solution, for validating the task set only. Never sent to the sandbox."""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "tests", tuple(TestCase.from_obj(t) for t in self.tests))
        if not self.tests:
            raise ValueError(f"task {self.task_id} has no tests")
        if self.difficulty is not None and self.difficulty not in (1, 2, 3):
            raise ValueError(f"task {self.task_id}: difficulty must be 1, 2 or 3")

    def to_dict(self, with_reference: bool = True) -> dict[str, Any]:
        d = asdict(self)
        d["tests"] = [t.to_spec() for t in self.tests]
        if not with_reference:
            d.pop("reference", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodeTask":
        d = dict(d)
        d["tests"] = tuple(TestCase.from_obj(t) for t in d["tests"])
        return cls(**d)


@functools.lru_cache(maxsize=4)
def _read_jsonl(path: str) -> tuple[CodeTask, ...]:
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tasks.append(CodeTask.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{n}: bad task: {e}") from None
    return tuple(tasks)


def load_code_tasks(
    split: str = "train",
    difficulty: int | Iterable[int] | None = None,
    path: str | Path | None = None,
    limit: int | None = None,
) -> list[CodeTask]:
    """The bundled tasks of ``split`` (train, test or all), optionally only some difficulties."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tasks = _read_jsonl(str(path or CODE_TASKS_FILE))
    if split != "all":
        tasks = tuple(t for t in tasks if t.split == split)
    if difficulty is not None:
        keep = {difficulty} if isinstance(difficulty, int) else set(difficulty)
        tasks = tuple(t for t in tasks if t.difficulty in keep)
    out = list(tasks)
    return out[:limit] if limit is not None else out


def task_by_id(task_id: str) -> CodeTask:
    """A bundled (``meshrl/...``) or HumanEval (``HumanEval/N``) task by its id."""
    if task_id.startswith("HumanEval/"):
        from meshrl.envs.humaneval import load_humaneval

        for t in load_humaneval():
            if t.task_id == task_id:
                return t
    else:
        for t in load_code_tasks("all"):
            if t.task_id == task_id:
                return t
    raise KeyError(f"no task '{task_id}'")
