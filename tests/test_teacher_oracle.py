"""The oracle teacher: right answers for the project's own arithmetic and code tasks, wrong ones at
the configured rate (and really wrong), phrasings that canonicalise alike, no vote on an unknown
problem; and the real server in a subprocess, driven by the project's TeacherClient and by raw
malformed requests."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import typing

import httpx
import pytest

from meshrl.config.env import EnvConfig
from meshrl.config.task import ArithmeticConfig
from meshrl.config.teachers import TeacherEndpointConfig
from meshrl.envs.arithmetic import ArithmeticTask, grade_integer_answer
from meshrl.envs.code_actions import parse_action
from meshrl.envs.code_env import CodeEnv, tasks_from_config
from meshrl.envs.grading import grade_many
from meshrl.envs.sandbox import Sandbox
from meshrl.replay.canonical import code, math_answer
from meshrl.teachers.client import TeacherClient, TeacherError
from meshrl.teachers.oracle import (ARITHMETIC_REPLIES, CODE_REPLIES, UNKNOWN_REPLY, CodeSource, Oracle,
                                    OracleConfig, OracleTeacherServer)
from meshrl.teachers.serve import TeacherServerError
from meshrl.testing.ports import free_port

MESHRL_TASKS = tasks_from_config(EnvConfig(split="all"))


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox()
    yield box
    box.close()


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _opening(task, sandbox) -> list[dict[str, str]]:
    """The conversation the code environment opens an episode of ``task`` with."""
    return CodeEnv(task, sandbox).reset().metadata["messages"]


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("template, system", [("What is {a} {op} {b}?", None),
                                              ("Compute {a}{op}{b}. Reply with a number.", "You add things.")])
def test_arithmetic_answers_are_exact_for_the_tasks_problems(template, system):
    task = ArithmeticTask(ArithmeticConfig(operators=["+", "-", "*"], min_value=-20, max_value=99,
                                           prompt_template=template, system_prompt=system))
    oracle = Oracle(OracleConfig(prompt_template=template, error_rate=0.0))
    problems = task.heldout(120)
    assert {p.meta["op"] for p in problems} == {"+", "-", "*"}
    for problem in problems:
        reply = oracle.reply(list(problem.messages))
        assert reply.outcome == "correct"
        assert math_answer(reply.text) == problem.answer
        assert task.grade(problem, reply.text)[0] == 1.0
    assert oracle.counts["correct"] == len(problems)


@pytest.mark.parametrize("template", ARITHMETIC_REPLIES)
def test_every_arithmetic_phrasing_canonicalises_to_its_result(template):
    for a, op, b, r in [(23, "+", 45, 68), (10, "-", 99, -89), (12, "*", 11, 132), (-5, "-", -7, 2), (0, "*", 7, 0)]:
        text = template.format(a=a, op=op, b=b, r=r)
        assert math_answer(text) == str(r), text
        assert grade_integer_answer(text, str(r))[0] == 1.0, text


def test_the_error_rate_is_honoured_and_honestly_counted():
    oracle = Oracle(OracleConfig(error_rate=0.2, seed=7))
    replies = [oracle.reply(_user("What is 31 * 17?")) for _ in range(2000)]
    wrong = [r for r in replies if math_answer(r.text) != "527"]
    assert abs(len(wrong) / 2000 - 0.2) < 0.03
    assert all(r.outcome == "wrong" for r in wrong)
    assert oracle.counts["wrong"] == len(wrong) and oracle.counts["correct"] == 2000 - len(wrong)
    assert len({r.text for r in replies if r.outcome == "correct"}) >= 4  # phrasings vary
    again = Oracle(OracleConfig(error_rate=0.2, seed=7))
    assert [again.reply(_user("What is 31 * 17?")).text for _ in range(50)] == [r.text for r in replies[:50]]


def test_two_wrong_teachers_rarely_agree():
    first, second = (Oracle(OracleConfig(error_rate=1.0, seed=s)) for s in (1, 2))
    pairs = [(first.reply(_user("What is 40 + 2?")), second.reply(_user("What is 40 + 2?"))) for _ in range(300)]
    answers = [(math_answer(x.text), math_answer(y.text)) for x, y in pairs]
    assert all(x != "42" and y != "42" for x, y in answers)
    assert sum(x == y for x, y in answers) / len(answers) < 0.1


def test_an_unknown_problem_casts_no_vote():
    assert math_answer(UNKNOWN_REPLY) is None and code(UNKNOWN_REPLY) is None
    arithmetic = Oracle(OracleConfig(error_rate=1.0))
    reply = arithmetic.reply(_user("What is the capital of France?") + [{"role": "assistant", "content": "Paris"}])
    assert (reply.outcome, reply.text) == ("unknown", UNKNOWN_REPLY)
    # only the last user message counts: an earlier problem is not the question being asked
    assert arithmetic.reply(_user("What is 2 + 3?") + _user("And the capital of France?")).outcome == "unknown"
    coder = Oracle(OracleConfig(task="code", error_rate=1.0))
    assert coder.reply(_user("def frobnicate(x):\n    'make it frob'")).outcome == "unknown"
    assert arithmetic.counts["unknown"] == 2 and coder.counts["unknown"] == 1


# ----------------------------------------------------------------------------- code


@pytest.mark.parametrize("template", CODE_REPLIES)
def test_every_code_phrasing_canonicalises_to_the_reference(template):
    for task in MESHRL_TASKS:
        text = template.format(code=task.reference.strip(), entry_point=task.entry_point)
        assert code(text) == code(task.reference), (task.task_id, text)
        assert code(parse_action(text).code) == code(task.reference)  # what the environment would run


def test_correct_code_replies_pass_every_task(sandbox):
    oracle = Oracle(OracleConfig(task="code", error_rate=0.0))
    replies = [oracle.reply(_opening(task, sandbox)) for task in MESHRL_TASKS]
    assert all(r.outcome == "correct" for r in replies)
    assert [code(r.text) for r in replies] == [code(t.reference) for t in MESHRL_TASKS]
    grades = grade_many([(t, parse_action(r.text).code) for t, r in zip(MESHRL_TASKS, replies)], sandbox)
    assert [t.task_id for t, g in zip(MESHRL_TASKS, grades) if not g.success] == []


def test_wrong_code_replies_fail_the_tests_and_vary(sandbox):
    oracle = Oracle(OracleConfig(task="code", error_rate=1.0, seed=5))
    tasks = [t for t in MESHRL_TASKS if t.difficulty == 2][:4]
    replies = [(task, oracle.reply(_opening(task, sandbox))) for task in tasks for _ in range(4)]
    assert all(r.outcome == "wrong" for _, r in replies)
    assert all(code(r.text) != code(task.reference) for task, r in replies)
    grades = grade_many([(t, parse_action(r.text).code) for t, r in replies], sandbox)
    assert not any(g.success for g in grades)
    assert len({code(r.text) for _, r in replies}) > len(tasks)  # more than one wrong variant per task


def test_the_task_is_found_later_in_an_episode_and_by_its_signature(sandbox):
    task = next(t for t in MESHRL_TASKS if t.entry_point == "sum_of_evens")
    env = CodeEnv(task, sandbox)
    env.reset()
    env.step("```python\ndef sum_of_evens(nums):\n    return 0\n```")
    oracle = Oracle(OracleConfig(task="code", error_rate=0.0))
    assert code(oracle.reply(env.state_at(1)).text) == code(task.reference)
    signature_only = _user("Please implement def sum_of_evens(nums: list[int]) -> int for me.")
    assert code(oracle.reply(signature_only).text) == code(task.reference)


@pytest.mark.parametrize("source", typing.get_args(CodeSource))
def test_every_code_source_is_indexed_over_all_splits(source):
    tasks = [t for t in tasks_from_config(EnvConfig(split="all", task_source=source)) if t.reference]
    oracle = Oracle(OracleConfig(task="code", code_source=source, error_rate=0.0))
    for task in tasks[:: max(1, len(tasks) // 10)]:
        assert code(oracle.reply(_user(task.prompt.rstrip() + "\n\nWrite it.")).text) == code(task.reference)


# ----------------------------------------------------------------------------- the server


def _endpoint(srv: OracleTeacherServer, **kw) -> TeacherEndpointConfig:
    return TeacherEndpointConfig(**{"name": "oracle", "base_url": srv.base_url, "model": "oracle", "max_retries": 0,
                                    "timeout_s": 10, "max_concurrency": 16, **kw})


MALFORMED = [  # (body, the field the error names)
    (b"{not json", "body"),
    ([1, 2], "body"),
    ({"messages": _user("What is 1 + 1?")}, "model"),
    ({"model": "oracle"}, "messages"),
    ({"model": "oracle", "messages": "What is 1 + 1?"}, "messages"),
    ({"model": "oracle", "messages": ["What is 1 + 1?"]}, "messages[0]"),
    ({"model": "oracle", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "oracle", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "oracle", "messages": _user("What is 1 + 1?"), "max_tokens": 0}, "max_tokens"),
    ({"model": "oracle", "messages": _user("What is 1 + 1?"), "max_tokens": "64"}, "max_tokens"),
    ({"model": "oracle", "messages": _user("What is 1 + 1?"), "temperature": 9}, "temperature"),
    ({"model": "oracle", "messages": _user("What is 1 + 1?"), "stream": True}, "stream"),
]


def test_arithmetic_server_end_to_end():
    cfg = OracleConfig(error_rate=0.5, latency_s=0.2, latency_jitter=0.25, seed=3)
    task = ArithmeticTask(ArithmeticConfig(operators=["+", "-", "*"]))
    problems = task.heldout(16)
    with OracleTeacherServer(cfg, port=free_port()) as srv:
        assert httpx.get(f"{srv.base_url}/models", timeout=5).json()["data"][0]["id"] == "oracle"
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5).status_code == 200

        async def ask_all():
            async with TeacherClient(_endpoint(srv)) as client:
                started = time.monotonic()
                replies = await asyncio.gather(*(client.chat(list(p.messages)) for p in problems))
                elapsed = time.monotonic() - started
                unknown = await client.chat(_user("Tell me a story."))
                failures = []
                for model, messages in (("gpt-9", _user("What is 1 + 1?")), ("oracle", [{"role": "user", "content": 7}])):
                    async with TeacherClient(_endpoint(srv, model=model)) as other:
                        with pytest.raises(TeacherError) as err:
                            await other.chat(messages)
                        failures.append(err.value)
                return replies, elapsed, unknown, failures, client.meter.total

        replies, elapsed, unknown, failures, spend = asyncio.run(ask_all())
        bad = []
        for body, field in MALFORMED:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = httpx.post(f"{srv.base_url}/chat/completions", timeout=5, **kw)
            error = response.json()["error"]
            bad.append((response.status_code, error["type"], error["message"].split(":")[0], "\n" in error["message"]))
        assert bad == [(400, "invalid_request_error", field, False) for _, field in MALFORMED]
        stats = srv.stats()
        pid = srv.proc.pid

    # latency honoured (0.15..0.25 s each), the 16 requests overlapping
    assert all(r.latency_s >= 0.15 for r in replies) and elapsed < 1.5
    wrong = sum(math_answer(r.text) != p.answer for r, p in zip(replies, problems))
    assert 0 < wrong < 16
    assert (stats["correct"], stats["wrong"], stats["unknown"]) == (16 - wrong, wrong, 1)
    assert math_answer(unknown.text) is None
    assert [f.kind for f in failures] == ["bad_request", "bad_request"]
    assert "does not exist" in failures[0].detail and "messages[0].content" in failures[1].detail
    assert stats["bad_requests"] == len(MALFORMED) + 2
    assert stats["requests"] == 16 + 1 + 2 + len(MALFORMED)
    assert spend.calls == 17 and spend.prompt_tokens > 0 and spend.completion_tokens > 0
    with pytest.raises(ProcessLookupError):  # the process group is gone
        os.killpg(pid, 0)


def test_code_server_answers_with_the_reference_and_honours_max_tokens(sandbox):
    task = next(t for t in MESHRL_TASKS if t.difficulty == 3)
    with OracleTeacherServer(OracleConfig(task="code", error_rate=0.0, served_name="coder"), port=free_port()) as srv:
        async def ask():
            async with TeacherClient(_endpoint(srv, model="coder")) as client:
                return await client.chat(_opening(task, sandbox))

        reply = asyncio.run(ask())
        body = {"model": "coder", "messages": _opening(task, sandbox), "max_tokens": 3}
        short = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=10).json()
    assert code(reply.text) == code(task.reference)
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3


def test_a_server_that_cannot_start_raises_with_its_last_output():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        srv = OracleTeacherServer(OracleConfig(), port=taken.getsockname()[1], start_timeout_s=30)
        with pytest.raises(TeacherServerError, match="exited with code"):
            srv.start()
