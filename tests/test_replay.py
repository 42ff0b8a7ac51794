"""Channel-3 trace replay against real HTTP teachers on loopback."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import pytest

from meshrl.teachers.client import SpendMeter, TeacherClient
from meshrl.config.replay import TeacherPanelConfig
from meshrl.config.teachers import TeacherEndpointConfig
from meshrl.replay.trace import ReplayResult, Trace, TraceStep, replay_trace, teacher_clients
from meshrl.testing.fake_openai import FakeOpenAIServer, Fault, count_tokens, prompt_tokens

SYSTEM = {"role": "system", "content": "Solve the problem. End with the final number."}
Q0 = {"role": "user", "content": "Q0: What is 2 + 3?"}
Q1 = {"role": "user", "content": "Wrong. Q1: What is 10 / 4?"}
Q2 = {"role": "user", "content": "Q2: What is 7 * 6?"}
STUDENT = ["I think 6", "<answer>2.5</answer>", "42"]
TRACE = Trace(
    episode_id="ep-17",
    steps=[
        TraceStep(context=[SYSTEM, Q0], action=STUDENT[0]),
        TraceStep(context=[SYSTEM, Q0, {"role": "assistant", "content": STUDENT[0]}, Q1], action=STUDENT[1]),
        TraceStep(
            context=[SYSTEM, Q0, {"role": "assistant", "content": STUDENT[0]}, Q1,
                     {"role": "assistant", "content": STUDENT[1]}, Q2],
            action=STUDENT[2],
        ),
    ],
)
# Per question, what each teacher answers: a and b are healthy, c fails differently every time.
ANSWERS = {
    "Q0": {"a": "2 + 3 = 5, so the answer is 5", "b": r"\boxed{5}", "c": Fault("server_error")},
    "Q1": {"a": "It is 5/2", "b": "2.50", "c": Fault("malformed_json")},
    "Q2": {"a": "41", "b": "43", "c": Fault("slow", 3.0)},
}


def scripted(model: str, messages: list[dict]) -> str | Fault:
    question = re.search(r"Q\d", messages[-1]["content"]).group()
    return ANSWERS[question][model]


def teacher(srv: FakeOpenAIServer, model: str, **overrides) -> dict:
    return dict(
        name=model, base_url=srv.base_url, model=model, timeout_s=0.3 if model == "c" else 2.0,
        max_retries=1, backoff_base_s=0.01, backoff_max_s=0.05,
        price_prompt_per_1m_usd=1.0, price_completion_per_1m_usd=2.0, **overrides,
    )


def run_replay(trace: Trace, cfg: TeacherPanelConfig, meter: SpendMeter | None = None) -> tuple[ReplayResult, list[TeacherClient]]:
    async def run():
        clients = teacher_clients(cfg, meter)
        try:
            return await replay_trace(trace, clients, cfg), clients
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(run())


def test_three_step_trace_against_three_teachers_one_faulty():
    with FakeOpenAIServer(script=scripted) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "abc"], agreement_k=2)
        started = time.monotonic()
        result, clients = run_replay(TRACE, cfg)
        elapsed = time.monotonic() - started
        requests = srv.chat_requests()

    # step 0: a and b agree on 5 against the student's 6, c failed -> one pair
    [pair] = result.pairs
    assert (pair.episode_id, pair.step_index) == ("ep-17", 0)
    assert pair.context == TRACE.steps[0].context
    assert pair.chosen == "2 + 3 = 5, so the answer is 5"  # the first agreeing teacher's raw reply
    assert pair.rejected == "I think 6"
    assert (pair.preference.votes, pair.preference.n_teachers, pair.preference.n_answered) == (2, 3, 2)
    assert pair.preference.agreeing_teachers == ("a", "b")

    # step 1: both answers equal the student's 5/2; step 2: 41 vs 43, no majority
    assert [s.reason for s in result.steps] == [None, "all_agree_with_student", "no_majority"]
    assert [s.student_canonical for s in result.steps] == ["6", "5/2", "42"]
    assert [s.failures for s in result.steps] == [{"c": "server_error"}, {"c": "malformed_json"}, {"c": "timeout"}]
    assert result.no_pair_reasons == Counter({"all_agree_with_student": 1, "no_majority": 1})

    assert result.teacher_calls == 9
    assert result.teacher_failures == Counter({"server_error": 1, "malformed_json": 1, "timeout": 1})
    assert (result.unusable_answers, result.steps_skipped, result.steps_timed_out) == (0, 0, 0)
    healthy = [(step, ANSWERS[f"Q{i}"][m]) for i, step in enumerate(TRACE.steps) for m in "ab"]
    expected_prompt = sum(prompt_tokens(step.context) for step, _ in healthy)
    expected_completion = sum(count_tokens(text) for _, text in healthy)
    assert (result.prompt_tokens, result.completion_tokens) == (expected_prompt, expected_completion)
    assert result.cost_usd == pytest.approx((expected_prompt * 1.0 + expected_completion * 2.0) / 1e6)
    assert elapsed < 3.0  # c's slow step is cut by its own timeout (2 x 0.3 s)

    # state replay: every teacher, on every attempt, received exactly the student's context
    for i, step in enumerate(TRACE.steps):
        received = [r for r in requests if r.messages[-1] == step.context[-1]]
        assert sorted(r.model for r in received) == (["a", "b", "c", "c"] if i in (0, 2) else ["a", "b", "c"])
        assert all(r.messages == step.context for r in received)

    assert [dict(c.counts) for c in clients] == [
        {"ok": 3}, {"ok": 3}, {"server_error": 1, "malformed_json": 1, "timeout": 1, "retries": 2},
    ]
    metrics = result.metrics()
    assert metrics["replay/pairs"] == 1 and metrics["replay/failures/timeout"] == 1
    assert metrics["replay/no_pair/no_majority"] == 1


@pytest.mark.parametrize(
    "fault, kind",
    [
        (Fault("slow", 3.0), "timeout"),
        (Fault("rate_limit", 0.01), "rate_limited"),
        (Fault("server_error"), "server_error"),
        (Fault("malformed_json"), "malformed_json"),
        (Fault("bad_schema"), "bad_schema"),
        (Fault("reset"), "connection"),
    ],
)
def test_every_fault_mode_is_counted_and_replay_goes_on(fault, kind):
    with FakeOpenAIServer(script={"a": "5", "b": "5", "c": "5"}, faults={"c": fault}) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "abc"])
        result, _ = run_replay(Trace("ep", [TraceStep([Q0], "6"), TraceStep([Q2], "5")]), cfg)
    assert [s.reason for s in result.steps] == [None, "all_agree_with_student"]
    assert len(result.pairs) == 1
    assert result.teacher_failures == Counter({kind: 2})


def test_wrong_api_key_is_counted_as_auth(monkeypatch):
    monkeypatch.setenv("C_KEY", "sk-wrong")
    with FakeOpenAIServer(script={"a": "5", "b": "5"}) as open_srv, \
            FakeOpenAIServer(script={"c": "5"}, api_key="sk-right") as auth_srv:
        cfg = TeacherPanelConfig(teachers=[teacher(open_srv, "a"), teacher(open_srv, "b"), teacher(auth_srv, "c", api_key_env="C_KEY")])
        result, _ = run_replay(Trace("ep", [TraceStep([Q0], "6")]), cfg)
    assert len(result.pairs) == 1
    assert result.teacher_failures == Counter({"auth": 1})


def test_unusable_replies_do_not_vote():
    with FakeOpenAIServer(script={"a": "5", "b": "I cannot say", "c": "no idea"}) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "abc"])
        result, _ = run_replay(Trace("ep", [TraceStep([Q0], "6")]), cfg)
    assert result.pairs == [] and result.unusable_answers == 2
    assert result.no_pair_reasons == Counter({"too_few_answers": 1})


def test_exhausted_budget_fails_fast_without_stopping_replay():
    with FakeOpenAIServer(script={"a": "5", "b": "5"}) as srv:
        cfg = TeacherPanelConfig(
            teachers=[teacher(srv, m, max_concurrency=1) for m in "ab"], budget_usd=1e-9,
        )
        meter = SpendMeter(budget_usd=cfg.budget_usd)
        trace = Trace("ep", [TraceStep([Q0], "6"), TraceStep([Q1], "6"), TraceStep([Q2], "6")])
        result, _ = run_replay(trace, cfg, meter)
        assert len(srv.chat_requests()) == 2  # the first call of each teacher spends the budget
    assert [s.reason for s in result.steps] == [None, "too_few_answers", "too_few_answers"]
    assert result.teacher_failures == Counter({"budget_exhausted": 4})
    assert meter.rejected_calls == 4 and meter.exhausted


def test_max_steps_per_trace_skips_the_rest():
    with FakeOpenAIServer(script={"a": "5", "b": "5"}) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "ab"], max_steps_per_trace=2)
        result, _ = run_replay(Trace("ep", [TraceStep([Q0], "6")] * 5), cfg)
        assert len(srv.chat_requests()) == 4
    assert (len(result.steps), result.steps_skipped, len(result.pairs)) == (2, 3, 2)


def test_trace_timeout_bounds_the_replay():
    with FakeOpenAIServer(script={"a": "5", "b": "5"}, faults={"a": Fault("slow", 3.0), "b": Fault("slow", 3.0)}) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "ab"], trace_timeout_s=0.3)
        started = time.monotonic()
        result, _ = run_replay(Trace("ep", [TraceStep([Q0], "6")] * 3), cfg)
        elapsed = time.monotonic() - started
    assert elapsed < 1.5
    assert (result.steps_timed_out, result.steps, result.pairs, result.teacher_calls) == (3, [], [], 0)


def test_cancelling_the_replay_cancels_its_teacher_calls():
    async def run(cfg):
        clients = teacher_clients(cfg)
        replay = asyncio.create_task(replay_trace(Trace("ep", [TraceStep([Q0], "6")] * 2), clients, cfg))
        await asyncio.sleep(0.2)
        replay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await replay
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for client in clients:
            await client.aclose()
        return leftovers

    with FakeOpenAIServer(script={"a": "5", "b": "5"}, faults={"a": Fault("slow", 3.0), "b": Fault("slow", 3.0)}) as srv:
        cfg = TeacherPanelConfig(teachers=[teacher(srv, m) for m in "ab"])
        assert asyncio.run(run(cfg)) == []


def test_empty_trace():
    cfg = TeacherPanelConfig(teachers=[TeacherEndpointConfig(name="a", base_url="http://127.0.0.1:9/v1", model="a")], agreement_k=1)
    result, _ = run_replay(Trace("ep", []), cfg)
    assert (result.steps, result.pairs, result.teacher_calls) == ([], [], 0)
