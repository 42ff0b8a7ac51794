"""TeacherClient against a real OpenAI-compatible server on loopback, one fault mode at a time."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshrl.teachers.client import SpendMeter, TeacherClient, TeacherError, TeacherReply
from meshrl.config.teachers import TeacherEndpointConfig
from meshrl.testing.fake_openai import FakeOpenAIServer, Fault

SECRET = "sk-test-7f3a91-THIS-KEY-MUST-NOT-BE-LOGGED"
WRONG_SECRET = "sk-test-0b22c4-WRONG-KEY-ALSO-SECRET"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]


def endpoint(srv: FakeOpenAIServer, model: str = "m", **overrides) -> TeacherEndpointConfig:
    fields = dict(
        name=f"teacher-{model}", base_url=srv.base_url, model=model, timeout_s=2.0,
        max_retries=2, backoff_base_s=0.01, backoff_max_s=0.05,
    )
    return TeacherEndpointConfig(**{**fields, **overrides})


def call(cfg: TeacherEndpointConfig, meter: SpendMeter | None = None) -> tuple[TeacherClient, TeacherReply | TeacherError, float]:
    """One chat call in a fresh event loop: (client, reply or error, elapsed seconds)."""

    async def run():
        async with TeacherClient(cfg, meter) as client:
            started = time.monotonic()
            try:
                outcome = await client.chat(MESSAGES)
            except TeacherError as e:
                outcome = e
            return client, outcome, time.monotonic() - started

    return asyncio.run(run())


def test_reply_text_usage_cost_and_request_body():
    with FakeOpenAIServer(script={"m": "The answer is 4"}) as srv:
        cfg = endpoint(srv, price_prompt_per_1m_usd=2.0, price_completion_per_1m_usd=10.0, max_tokens=64)
        client, reply, _ = call(cfg)
        [request] = srv.chat_requests()
    assert isinstance(reply, TeacherReply)
    assert reply.text == "The answer is 4"
    assert (reply.prompt_tokens, reply.completion_tokens, reply.attempts) == (5, 4, 1)
    assert reply.cost_usd == pytest.approx((5 * 2.0 + 4 * 10.0) / 1e6)
    assert request.body == {"model": "m", "messages": MESSAGES, "temperature": 0.0, "max_tokens": 64}
    assert "authorization" not in {h.lower() for h in request.headers}
    assert client.counts == {"ok": 1}
    assert client.meter.by_teacher["teacher-m"].completion_tokens == 4


def test_transient_server_errors_are_retried_until_success():
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": [Fault("server_error"), Fault("server_error")]}) as srv:
        client, reply, _ = call(endpoint(srv))
        assert len(srv.chat_requests()) == 3
    assert isinstance(reply, TeacherReply) and reply.text == "4" and reply.attempts == 3
    assert client.counts == {"ok": 1, "retries": 2}


@pytest.mark.parametrize(
    "fault, kind",
    [(Fault("server_error"), "server_error"), (Fault("reset"), "connection"), (Fault("rate_limit", 0.01), "rate_limited")],
)
def test_persistent_retryable_fault_gives_up_after_max_retries(fault, kind):
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": fault}) as srv:
        client, error, _ = call(endpoint(srv, max_retries=2))
        assert len(srv.chat_requests()) == 3
    assert isinstance(error, TeacherError)
    assert (error.kind, error.attempts, error.teacher) == (kind, 3, "teacher-m")
    assert client.counts == {kind: 1, "retries": 2}


@pytest.mark.parametrize("fault, kind", [(Fault("malformed_json"), "malformed_json"), (Fault("bad_schema"), "bad_schema")])
def test_unusable_body_is_not_retried(fault, kind):
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": fault}) as srv:
        client, error, _ = call(endpoint(srv))
        assert len(srv.chat_requests()) == 1
    assert isinstance(error, TeacherError) and (error.kind, error.attempts) == (kind, 1)
    assert client.counts == {kind: 1}


def test_client_error_other_than_429_is_not_retried():
    with FakeOpenAIServer(script={"other-model": "4"}) as srv:  # unknown model: 404
        client, error, _ = call(endpoint(srv))
        assert len(srv.chat_requests()) == 1
    assert isinstance(error, TeacherError) and (error.kind, error.attempts) == ("bad_request", 1)
    assert "404" in str(error)


def test_connection_refused_is_a_connection_error():
    srv = FakeOpenAIServer(script={"m": "4"}).start()
    cfg = endpoint(srv, max_retries=1)
    srv.stop()
    client, error, _ = call(cfg)
    assert isinstance(error, TeacherError) and (error.kind, error.attempts) == ("connection", 2)


def test_retry_after_is_honoured():
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": [Fault("rate_limit", 1.0)]}) as srv:
        client, reply, elapsed = call(endpoint(srv, backoff_max_s=5.0))
    assert isinstance(reply, TeacherReply) and reply.attempts == 2
    assert 0.95 <= elapsed < 2.0  # our own backoff alone would be at most 0.01 s
    assert client.counts == {"ok": 1, "retries": 1}


def test_retry_after_is_capped_by_backoff_max():
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": Fault("rate_limit", 30)}) as srv:
        _, error, elapsed = call(endpoint(srv, max_retries=1, backoff_max_s=0.2))
    assert isinstance(error, TeacherError) and error.kind == "rate_limited"
    assert 0.2 <= elapsed < 1.5


def test_slow_server_times_out_in_bounded_time():
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": Fault("slow", 5.0)}) as srv:
        client, error, elapsed = call(endpoint(srv, timeout_s=0.3, max_retries=1))
    assert isinstance(error, TeacherError) and (error.kind, error.attempts) == ("timeout", 2)
    assert elapsed < 1.5
    assert client.counts == {"timeout": 1, "retries": 1}


def test_slow_server_within_timeout_still_answers():
    with FakeOpenAIServer(script={"m": "4"}, faults={"m": Fault("slow", 0.3)}) as srv:
        _, reply, _ = call(endpoint(srv, timeout_s=2.0))
    assert isinstance(reply, TeacherReply) and reply.text == "4" and reply.latency_s >= 0.3


@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_limit_is_honoured(limit):
    async def run(cfg):
        async with TeacherClient(cfg) as client:
            replies = await asyncio.gather(*(client.chat(MESSAGES) for _ in range(6)))
            return client, replies

    with FakeOpenAIServer(script={"m": "4"}, faults={"m": Fault("slow", 0.15)}) as srv:
        client, replies = asyncio.run(run(endpoint(srv, max_concurrency=limit)))
        assert srv.max_in_flight("m") == limit
    assert [r.text for r in replies] == ["4"] * 6
    assert client.counts == {"ok": 6}


def test_calls_waiting_for_a_slot_do_not_use_up_their_timeout():
    async def run(cfg):
        async with TeacherClient(cfg) as client:
            return await asyncio.gather(*(client.chat(MESSAGES) for _ in range(3)))

    with FakeOpenAIServer(script={"m": "4"}, faults={"m": Fault("slow", 0.2)}) as srv:
        replies = asyncio.run(run(endpoint(srv, max_concurrency=1, timeout_s=0.5, max_retries=0)))
    assert [r.attempts for r in replies] == [1, 1, 1]  # the third waited ~0.4 s, then took ~0.2 s


def test_shared_budget_exhaustion_fails_fast_and_is_counted(caplog):
    async def run(cfg_a, cfg_b):
        meter = SpendMeter(budget_usd=0.015)
        async with TeacherClient(cfg_a, meter) as a, TeacherClient(cfg_b, meter) as b:
            await a.chat(MESSAGES)  # 0.01
            await b.chat(MESSAGES)  # 0.02: over budget, but it was admitted at 0.01
            with pytest.raises(TeacherError) as excinfo:
                await a.chat(MESSAGES)
            with pytest.raises(TeacherError):
                await b.chat(MESSAGES)
            return meter, a, excinfo.value

    with FakeOpenAIServer(script={"a": "4", "b": "4"}) as srv:
        # one completion token per call at $10,000 per million tokens = $0.01 per call
        price = dict(price_completion_per_1m_usd=10_000.0)
        meter, a, error = asyncio.run(run(endpoint(srv, "a", **price), endpoint(srv, "b", **price)))
        assert len(srv.chat_requests()) == 2
    assert (error.kind, error.attempts) == ("budget_exhausted", 0)
    assert meter.exhausted and meter.rejected_calls == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # exactly one warning (Monarch, once imported, prefixes log records with the actor name)
    assert len(warnings) == 1
    assert warnings[0].endswith("spend budget of $0.0150 used up ($0.0200 spent): teacher calls now fail fast")
    assert meter.total.cost_usd == pytest.approx(0.02) and meter.total.calls == 2
    assert meter.by_teacher["teacher-a"].cost_usd == pytest.approx(0.01)
    assert a.counts == {"ok": 1, "budget_exhausted": 1}


def test_missing_usage_is_estimated_and_counted():
    with FakeOpenAIServer(script={"m": "four " * 40}, report_usage=False) as srv:
        client, reply, _ = call(endpoint(srv, price_completion_per_1m_usd=1.0))
    assert isinstance(reply, TeacherReply)
    assert reply.completion_tokens == 50 and reply.prompt_tokens > 0  # 200 characters / 4
    assert reply.cost_usd == pytest.approx(50 / 1e6)
    assert client.counts == {"ok": 1, "usage_estimated": 1}


def test_api_key_goes_to_the_server_and_nowhere_else(monkeypatch, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    with FakeOpenAIServer(script={"m": "4"}, api_key=SECRET) as srv:
        monkeypatch.setenv("TEACHER_KEY", SECRET)
        client, reply, _ = call(endpoint(srv, api_key_env="TEACHER_KEY"))
        assert isinstance(reply, TeacherReply)
        assert srv.chat_requests()[0].headers["Authorization"] == f"Bearer {SECRET}"

        # a wrong key: the server's 401 body quotes it, our error must not
        monkeypatch.setenv("TEACHER_KEY", WRONG_SECRET)
        wrong_client, error, _ = call(endpoint(srv, api_key_env="TEACHER_KEY"))
        assert isinstance(error, TeacherError) and (error.kind, error.attempts) == ("auth", 1)
        assert len(srv.chat_requests()) == 2  # not retried

        monkeypatch.delenv("TEACHER_KEY")
        _, missing, _ = call(endpoint(srv, api_key_env="TEACHER_KEY"))
        assert isinstance(missing, TeacherError) and missing.kind == "auth" and "TEACHER_KEY" in str(missing)
        assert len(srv.chat_requests()) == 2  # no request without the key

    assert "Incorrect API key" in error.detail and "***" in error.detail
    chained, cause = [], error  # the SDK's exception, whose message quotes the body, is not chained
    while cause is not None:
        chained.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    assert not any(WRONG_SECRET in text for text in chained)
    captured = capfd.readouterr()
    assert "teacher-m" in caplog.text  # the warnings were captured
    for secret in (SECRET, WRONG_SECRET):
        for text in (str(error), repr(error), error.detail, caplog.text, captured.out, captured.err,
                     repr(client), repr(wrong_client), repr(reply)):
            assert secret not in text


def test_ambient_openai_credentials_never_reach_a_teacher(monkeypatch):
    ambient = {"OPENAI_API_KEY": SECRET, "OPENAI_ORG_ID": "org-ambient", "OPENAI_PROJECT_ID": "proj-ambient"}
    for name, value in ambient.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TEACHER_KEY", WRONG_SECRET)
    with FakeOpenAIServer(script={"m": "4"}) as srv:
        _, without_key, _ = call(endpoint(srv))
        _, with_key, _ = call(endpoint(srv, api_key_env="TEACHER_KEY"))
        anonymous, keyed = srv.chat_requests()
    assert isinstance(without_key, TeacherReply) and isinstance(with_key, TeacherReply)
    for request in (anonymous, keyed):
        assert "openai-organization" not in request.headers and "openai-project" not in request.headers
    assert "authorization" not in anonymous.headers
    assert keyed.headers["authorization"] == f"Bearer {WRONG_SECRET}"


class FixedBodyServer:
    """Loopback HTTP server answering every request with status 200 and one body, for bodies the
    fake OpenAI server does not send (a proxy's HTML page, JSON that is not an object, ...)."""

    def __init__(self, content_type: str, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FixedBodyServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


COMPLETION = b'{"choices": [{"message": {"role": "assistant", "content": "4"}}]}'


@pytest.mark.parametrize(
    "content_type, body, kind",
    [
        ("text/html", b"<html><body>Please sign in</body></html>", "malformed_json"),
        ("application/json", b'{"choices": [{"message": {"content": "\xff\xfe"}}]}', "malformed_json"),
        ("application/json", b"[1, 2]", "bad_schema"),
        ("application/json", b"null", "bad_schema"),
        ("application/json", b'{"choices": []}', "bad_schema"),
        ("application/json", b'{"choices": [{"message": "4"}]}', "bad_schema"),
        ("application/json", b'{"choices": [{"message": {"content": null, "tool_calls": []}}]}', "bad_schema"),
        ("text/plain", COMPLETION, None),  # JSON is read whatever the declared type
        ("application/json", COMPLETION, None),  # no other field of a completion is required
    ],
)
def test_a_2xx_body_is_a_chat_completion_or_fails_without_retry(content_type, body, kind):
    with FixedBodyServer(content_type, body) as srv:
        client, outcome, _ = call(endpoint(srv))
    if kind is None:
        assert isinstance(outcome, TeacherReply) and outcome.text == "4"
        assert client.counts == {"ok": 1, "usage_estimated": 1}
    else:
        assert isinstance(outcome, TeacherError) and (outcome.kind, outcome.attempts) == (kind, 1)
        assert client.counts == {kind: 1}
