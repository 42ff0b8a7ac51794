"""The optional LLM hint generator, through the teacher client, against the loopback server."""

from __future__ import annotations

import asyncio

from meshrl.teachers.client import TeacherClient
from meshrl.config.sdpo import HintGeneratorConfig
from meshrl.sdpo.hints import LLMHintGenerator, render_transcript
from meshrl.testing.fake_openai import FakeOpenAIServer, Fault

CONTEXT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write add(a, b)."},
]


def ask(srv: FakeOpenAIServer, model: str, error_text: str = "AssertionError: add(1, 2) == 4", **overrides):
    cfg = HintGeneratorConfig(
        enabled=True,
        endpoint={"name": "hinter", "base_url": srv.base_url, "model": model, "max_retries": 0},
        **overrides,
    )

    async def run():
        async with TeacherClient(cfg.endpoint) as client:
            generator = LLMHintGenerator(client, cfg)
            return generator, await generator.hint(CONTEXT, "test_failure", error_text)

    return asyncio.run(run())


def test_hint_prompt_carries_instruction_context_and_error():
    with FakeOpenAIServer(script={"h": "  Check the operator you used.  "}) as srv:
        generator, hint = ask(srv, "h", error_text="E" * 50, max_error_chars=20)
        [request] = srv.chat_requests()
    assert hint == "Check the operator you used."
    system, user = request.messages
    assert system == {"role": "system", "content": generator.cfg.instruction}
    assert "user: Write add(a, b)." in user["content"] and "(test_failure)" in user["content"]
    assert "E" * 20 in user["content"] and "E" * 21 not in user["content"]
    assert generator.counts == {"ok": 1}


def test_long_hint_is_cut():
    with FakeOpenAIServer(script={"h": "x" * 1000}) as srv:
        _, hint = ask(srv, "h", max_hint_chars=50)
    assert hint == "x" * 50


def test_teacher_error_and_empty_reply_give_none_and_are_counted():
    with FakeOpenAIServer(script={"h": "hint", "blank": "  "}, faults={"h": Fault("server_error")}) as srv:
        failing, failed_hint = ask(srv, "h")
        empty, empty_hint = ask(srv, "blank")
    assert failed_hint is None and failing.counts == {"server_error": 1}
    assert empty_hint is None and empty.counts == {"empty": 1}


def test_transcript_keeps_the_end_of_long_conversations():
    messages = [{"role": "user", "content": "a" * 500}, {"role": "assistant", "content": "the end"}]
    text = render_transcript(messages, max_chars=100)
    assert text.startswith("...") and text.endswith("assistant: the end") and len(text) == 103
