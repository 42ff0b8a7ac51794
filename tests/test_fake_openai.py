"""The loopback fake is a real OpenAI-compatible server: the official SDK can talk to it, and its
connection-reset fault really resets the TCP connection."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from meshrl.testing.fake_openai import FakeOpenAIServer, Fault


def test_official_sdk_reads_completions_and_models():
    script = {"alpha": lambda messages: messages[-1]["content"].upper(), "beta": "fixed"}
    with FakeOpenAIServer(script=script) as srv:
        sdk = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        completion = sdk.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "two words"}])
        models = sorted(m.id for m in sdk.models.list())
    assert completion.choices[0].message.content == "TWO WORDS"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 2)
    assert models == ["alpha", "beta"]


def test_faults_follow_the_per_model_request_plan():
    with FakeOpenAIServer(script={"m": "ok"}, faults={"m": [None, Fault("server_error")]}) as srv:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        statuses = [httpx.post(f"{srv.base_url}/chat/completions", json=body).status_code for _ in range(3)]
    assert statuses == [200, 500, 200]


def test_reset_fault_aborts_the_tcp_connection():
    with FakeOpenAIServer(script={"m": "ok"}, faults={"m": Fault("reset")}) as srv:
        host, port = srv.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(request)
            with pytest.raises(ConnectionResetError):
                sock.recv(1024)


def test_script_can_return_faults_depending_on_the_messages():
    def script(model, messages):
        question = messages[-1]["content"]
        return {"late": Fault("slow", 0.2, text="finally"), "broken": Fault("bad_schema")}.get(question, "plain")

    with FakeOpenAIServer(script=script) as srv:
        def ask(question):
            body = {"model": "any", "messages": [{"role": "user", "content": question}]}
            return httpx.post(f"{srv.base_url}/chat/completions", json=body).json()

        late = ask("late")
        assert late["choices"][0]["message"]["content"] == "finally"
        assert "choices" not in ask("broken")
        assert ask("other")["choices"][0]["message"]["content"] == "plain"
        assert srv.max_in_flight("any") == 1
