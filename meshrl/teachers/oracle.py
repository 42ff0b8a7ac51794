"""An oracle teacher: an OpenAI-compatible chat server that knows the reference answers.

This is a stand-in for a frontier model, not a model. It recognises the project's own tasks in the
conversation and answers from what the task generator knows: the exact result of an arithmetic
problem (``meshrl.envs.arithmetic``), the reference solution of a code task (``meshrl.envs.tasks``).
It is therefore stronger than any real teacher, except that with probability ``error_rate`` a reply
is wrong on purpose: an arithmetic result plus a random nonzero offset (so two wrong replies rarely
agree), or a one-change mutant of the reference (a constant off by one, a flipped comparison or
``and``/``or``, ``+``/``-`` swapped, a body returning None or its first argument) that the task's
hidden tests reject: mutants are checked in the sandbox the first time a task needs one. Replies
vary in phrasing, and every phrasing canonicalises (``meshrl.replay.canonical``) to the same
answer. A conversation it does not recognise gets ``UNKNOWN_REPLY``, which canonicalises to None
and so casts no vote.

Served: ``POST /v1/chat/completions`` (non-streaming, OpenAI's chat.completion schema; ``usage``
counts whitespace-separated words as tokens, an estimate), ``GET /v1/models``, ``GET /health`` and
``GET /stats`` (counters). A malformed request gets 400 with ``{"error": {"message": <one line
naming the field>, "type": "invalid_request_error"}}``; an unknown model gets 404.

    with OracleTeacherServer(OracleConfig(task="arithmetic", error_rate=0.2), port=8001) as srv: srv.base_url

``python -m meshrl.teachers.oracle --config '<OracleConfig JSON>' --port 8001`` runs the server in
the foreground (``meshrl teachers oracle`` is the command-line front end).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import copy
import json
import random
import re
import string
import sys
import threading
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from meshrl.config.base import Section
from meshrl.config.env import EnvConfig
from meshrl.config.task import ArithmeticConfig
from meshrl.envs.arithmetic import OPERATIONS as ARITHMETIC_OPS
from meshrl.envs.code_env import tasks_from_config
from meshrl.envs.grading import grade_many
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.tasks import CodeTask
from meshrl.teachers.serve import TeacherServerProcess

CodeSource = EnvConfig.model_fields["task_source"].annotation
"""The code task sources an ``EnvConfig`` can select (its ``task_source`` values)."""

UNKNOWN_REPLY = "# I do not know the answer to this problem."
"""The reply to a conversation the oracle does not recognise: no number (``math_answer`` gives
None) and only a Python comment (``code`` gives None)."""

ARITHMETIC_REPLIES = (
    "The answer is {r}.",
    "{a} {op} {b} = {r}",
    "{r}",
    "\\boxed{{{r}}}",
    "Working it out, {a} {op} {b} gives {r}. So the answer is {r}.",
    "<answer>{r}</answer>",
)
"""Phrasings of an arithmetic reply; ``{r}`` is the result given (right or wrong)."""

CODE_REPLIES = (
    "```python\n{code}\n```",
    "Here is the complete function:\n\n```python\n{code}\n```",
    "```python\n{code}\n```\n\nThis handles the examples in the docstring and the edge cases.",
    "```python\n# {entry_point}: complete solution\n{code}\n```",
    "Let me write `{entry_point}`.\n\n```python\n{code}\n```\nIt returns the required value for every input.",
)
"""Phrasings of a code reply, in the action format of the code environment (a fenced block)."""

_FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
          ast.And: ast.Or, ast.Or: ast.And, ast.Add: ast.Sub, ast.Sub: ast.Add}
"""The operator a mutant puts in place of each operator it changes."""

MAX_MUTANTS = 8
"""Mutants of one reference checked in the sandbox (a seeded sample of the mutation sites)."""

PROVEN_WRONG = ("test_failure", "runtime_error")
"""How a mutant must fail to be given as a wrong answer: a wrong value or an exception. One that
only times out (or hits another limit) might be right on a less busy machine, so it is not used."""


class OracleConfig(Section):
    """What the oracle teacher answers, how often it is wrong, and how slowly."""

    task: Literal["arithmetic", "code"] = "arithmetic"
    """Task family it recognises."""

    prompt_template: str = ArithmeticConfig.model_fields["prompt_template"].default
    """The arithmetic prompt template (`task.arithmetic.prompt_template` of the run)."""

    code_source: CodeSource = "meshrl"
    """Code tasks it knows (an `env.task_source` value); every split is indexed."""

    error_rate: float = Field(0.2, ge=0, le=1)
    """Probability that a reply to a recognised problem is wrong."""

    latency_s: float = Field(0.0, ge=0)
    """Mean delay before each reply, slept without blocking other requests."""

    latency_jitter: float = Field(0.5, ge=0, le=1)
    """The delay is uniform in `latency_s * (1 -/+ latency_jitter)`."""

    seed: int = 0
    """Seed of the random draws (wrong or right, phrasing, error, delay)."""

    served_name: str = Field("oracle", min_length=1)
    """Model name listed by /v1/models and required in requests."""

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        fields = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
        if sorted(fields) != ["a", "b", "op"]:
            raise ValueError("a template with the fields {a}, {op} and {b}, each once")
        return value


# ----------------------------------------------------------------------------- knowing the answers


def _user_texts(messages: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


class ArithmeticSolver:
    """Finds 'a op b' (as the prompt template writes it) in the last user message."""

    def __init__(self, prompt_template: str):
        ops = "".join(re.escape(op) for op in ARITHMETIC_OPS)
        groups = {"a": r"(?P<a>-?\d+)", "op": rf"(?P<op>[{ops}])", "b": r"(?P<b>-?\d+)"}
        self._pattern = re.compile("".join(re.escape(literal) + (groups[name] if name else "")
                                           for literal, name, _, _ in string.Formatter().parse(prompt_template)))

    def find(self, messages: list[dict[str, str]]) -> tuple[int, str, int] | None:
        """(a, op, b) of the problem, or None."""
        users = _user_texts(messages)
        match = self._pattern.search(users[-1]) if users else None
        return (int(match["a"]), match["op"], int(match["b"])) if match else None

    def reply(self, problem: tuple[int, str, int], wrong: bool, rng: random.Random) -> str:
        a, op, b = problem
        result = ARITHMETIC_OPS[op](a, b)
        if wrong:
            result += rng.choice((-1, 1)) * rng.randint(1, 20)
        return rng.choice(ARITHMETIC_REPLIES).format(a=a, op=op, b=b, r=result)


def _entry_point(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                None)


def _mutation_sites(fn: ast.AST) -> list[ast.AST]:
    """Nodes of ``fn`` that one small change makes (most likely) wrong, in a fixed order."""
    return [n for n in ast.walk(fn)
            if (isinstance(n, ast.Constant) and type(n.value) is int)
            or (isinstance(n, (ast.BinOp, ast.BoolOp, ast.AugAssign)) and type(n.op) in _FLIPS)
            or (isinstance(n, ast.Compare) and type(n.ops[0]) in _FLIPS)]


def _mutate(node: ast.AST) -> None:
    if isinstance(node, ast.Constant):
        node.value += 1
    elif isinstance(node, ast.Compare):
        node.ops = [_FLIPS[type(node.ops[0])](), *node.ops[1:]]
    else:
        node.op = _FLIPS[type(node.op)]()


def code_mutants(task: CodeTask) -> list[str]:
    """Variants of the reference that each change one thing in the entry point (an int constant
    + 1, a flipped comparison, ``and``/``or`` or ``+``/``-`` swapped; at most ``MAX_MUTANTS``, a
    sample seeded by the task id), plus bodies that return None or the first argument. Not checked
    here: most, not all, are wrong."""
    tree = ast.parse(task.reference or "")
    fn = _entry_point(tree, task.entry_point)
    if fn is None:
        return []
    n_sites = len(_mutation_sites(fn))
    mutants = []
    for index in sorted(random.Random(task.task_id).sample(range(n_sites), min(MAX_MUTANTS, n_sites))):
        mutant = copy.deepcopy(tree)
        _mutate(_mutation_sites(_entry_point(mutant, task.entry_point))[index])
        mutants.append(ast.unparse(mutant))
    for value in (ast.Constant(None), *(ast.Name(arg.arg) for arg in fn.args.args[:1])):
        stub = copy.deepcopy(tree)
        _entry_point(stub, task.entry_point).body = [ast.Return(value)]
        mutants.append(ast.unparse(stub))
    return list(dict.fromkeys(mutants))


class CodeSolver:
    """Finds a code task in the conversation: its prompt in a user message, else a user message
    naming ``def <entry_point>(`` of exactly one task. Only tasks with a reference are known."""

    def __init__(self, code_source: str):
        tasks = [t for t in tasks_from_config(EnvConfig(split="all", task_source=code_source)) if t.reference]
        self._by_prompt = {t.prompt.strip(): t for t in tasks}
        by_name: dict[str, list[CodeTask]] = {}
        for t in tasks:
            by_name.setdefault(t.entry_point, []).append(t)
        self._by_entry_point = {name: ts[0] for name, ts in by_name.items() if len(ts) == 1}
        self._wrong: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None

    def find(self, messages: list[dict[str, str]]) -> CodeTask | None:
        users = _user_texts(messages)
        found = [p for p in self._by_prompt if any(p in text for text in users)]
        if found:
            return self._by_prompt[max(found, key=len)]
        for name in (n for text in users for n in re.findall(r"\bdef\s+(\w+)\s*\(", text)):
            if name in self._by_entry_point:
                return self._by_entry_point[name]
        return None

    def failing_mutants(self, task: CodeTask) -> list[str]:
        """The mutants of ``task``'s reference that fail its tests in the sandbox with a wrong
        value or an exception (checked once per task)."""
        with self._lock:
            if task.task_id not in self._wrong:
                self._sandbox = self._sandbox or Sandbox(EnvConfig().sandbox)
                mutants = code_mutants(task)
                grades = grade_many([(task, m) for m in mutants], self._sandbox, exec_timeout=3.0, test_timeout=1.0)
                self._wrong[task.task_id] = [m for m, g in zip(mutants, grades)
                                             if g.complete and g.error_kind in PROVEN_WRONG]
            return self._wrong[task.task_id]

    def reply(self, task: CodeTask, wrong: bool, rng: random.Random) -> str | None:
        """The reference (or, when ``wrong``, a failing mutant: None if it has none), phrased."""
        code = task.reference
        if wrong:
            mutants = self.failing_mutants(task)
            if not mutants:
                return None
            code = rng.choice(mutants)
        return rng.choice(CODE_REPLIES).format(code=code.strip(), entry_point=task.entry_point)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


@dataclass(frozen=True)
class OracleReply:
    """One reply and how it was meant: ``correct``, ``wrong`` or ``unknown``."""

    text: str
    outcome: Literal["correct", "wrong", "unknown"]
    delay_s: float


class Oracle:
    """The answer logic, without HTTP: ``Oracle(cfg).reply(messages)``; thread-safe. ``counts``
    has ``correct``, ``wrong``, ``unknown`` and ``wrong_unavailable`` (a wrong reply was drawn for
    a code task none of whose mutants fails its tests, so the reply given is correct)."""

    def __init__(self, cfg: OracleConfig):
        self.cfg = cfg
        self.solver = ArithmeticSolver(cfg.prompt_template) if cfg.task == "arithmetic" else CodeSolver(cfg.code_source)
        self._counts = Counter({k: 0 for k in ("correct", "wrong", "unknown", "wrong_unavailable")})
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()

    @property
    def counts(self) -> dict[str, int]:
        """Replies so far by outcome, and ``wrong_unavailable``."""
        with self._lock:
            return dict(self._counts)

    def reply(self, messages: list[dict[str, str]]) -> OracleReply:
        """The reply to a conversation (the last user message for arithmetic, any for code)."""
        cfg = self.cfg
        with self._lock:  # every draw of one request comes from its own generator, seeded in order
            wrong = self._rng.random() < cfg.error_rate
            delay = cfg.latency_s * (1 + self._rng.uniform(-cfg.latency_jitter, cfg.latency_jitter))
            rng = random.Random(self._rng.getrandbits(64))
        problem = self.solver.find(messages)
        if problem is None:
            outcome, text = "unknown", UNKNOWN_REPLY
        else:
            outcome, text = ("wrong" if wrong else "correct"), self.solver.reply(problem, wrong, rng)
            if text is None:
                outcome, text = "correct", self.solver.reply(problem, False, rng)
                self._add("wrong_unavailable")
        self._add(outcome)
        return OracleReply(text, outcome, delay)

    def _add(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def close(self) -> None:
        if isinstance(self.solver, CodeSolver):
            self.solver.close()


# ----------------------------------------------------------------------------- the HTTP server


class BadRequest(ValueError):
    """A malformed chat request; the message is one line naming the field."""


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_chat_request(raw: bytes) -> dict[str, Any]:
    """The request body as a dict whose ``model``, ``messages``, ``max_tokens``/``max_completion_tokens``,
    ``temperature``, ``n`` and ``stream`` are valid; ``BadRequest`` naming the first bad field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("body: not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("model: required, a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: required, a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]: must be an object with role and content")
        if m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}].role: must be one of {', '.join(sorted(_ROLES))}")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content: must be a string")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise BadRequest(f"{key}: must be a positive integer")
    temperature = body.get("temperature")
    if temperature is not None and (type(temperature) not in (int, float) or not 0 <= temperature <= 2):
        raise BadRequest("temperature: must be a number between 0 and 2")
    if body.get("n") not in (None, 1):
        raise BadRequest("n: only 1 is supported")
    if body.get("stream") not in (None, False):
        raise BadRequest("stream: streaming is not supported")
    return body


def _words(text: str) -> int:
    return len(text.split())


def _truncate(text: str, max_tokens: int | None) -> tuple[str, str]:
    """The text cut after ``max_tokens`` words, and the finish reason."""
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    if max_tokens is None or len(ends) <= max_tokens:
        return text, "stop"
    return text[: ends[max_tokens - 1]], "length"


def create_app(oracle: Oracle) -> FastAPI:
    """The FastAPI app serving ``oracle``."""
    cfg = oracle.cfg
    http = Counter()

    @asynccontextmanager
    async def lifespan(app):
        yield
        oracle.close()

    app = FastAPI(title="meshrl oracle teacher", lifespan=lifespan)

    def error(status: int, message: str, code: str | None = None) -> JSONResponse:
        http["bad_requests"] += 1
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}}, status_code=status)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.served_name, "object": "model", "created": 0,
                                            "owned_by": "meshrl-oracle"}]}

    @app.get("/stats")
    def stats() -> dict:
        return {"requests": http["requests"], "bad_requests": http["bad_requests"], **oracle.counts}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        http["requests"] += 1
        try:
            body = parse_chat_request(await request.body())
        except BadRequest as exc:
            return error(400, str(exc))
        if body["model"] != cfg.served_name:
            return error(404, f"model: '{body['model']}' does not exist; this server serves '{cfg.served_name}'",
                         "model_not_found")
        reply = await asyncio.to_thread(oracle.reply, body["messages"])
        await asyncio.sleep(reply.delay_s)
        text, finish = _truncate(reply.text, body.get("max_completion_tokens") or body.get("max_tokens"))
        prompt = sum(_words(m["content"]) for m in body["messages"])
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": cfg.served_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": _words(text),
                      "total_tokens": prompt + _words(text)},
        }

    return app


class OracleTeacherServer(TeacherServerProcess):
    """The oracle in a subprocess on loopback: ``with OracleTeacherServer(cfg, port=8001) as srv``;
    ``srv.stats()`` reads its counters."""

    poll_interval_s = 0.1

    def __init__(self, cfg: OracleConfig, port: int = 8001, start_timeout_s: float = 60.0,
                 log_path: Path | None = None):
        super().__init__(cfg.served_name, port, start_timeout_s, log_path)
        self.cfg = cfg

    def command(self) -> list[str]:
        return [sys.executable, "-m", "meshrl.teachers.oracle", "--config", self.cfg.model_dump_json(),
                "--port", str(self.port)]

    def stats(self, timeout_s: float = 5.0) -> dict[str, int]:
        """The server's counters (``GET /stats``)."""
        response = httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=timeout_s)
        response.raise_for_status()
        return response.json()


def main(argv: list[str] | None = None) -> None:
    """Serve the oracle in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m meshrl.teachers.oracle", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="{}", help="OracleConfig as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    oracle = Oracle(OracleConfig.model_validate_json(args.config))
    uvicorn.run(create_app(oracle), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
