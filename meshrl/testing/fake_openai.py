"""A real OpenAI-compatible HTTP server on loopback for tests: scripted answers and fault modes.

    with FakeOpenAIServer(script={"teacher-a": "42"}, faults={"teacher-b": Fault("server_error")}) as srv:
        client = TeacherClient(TeacherEndpointConfig(name="a", base_url=srv.base_url, model="teacher-a"))

It serves ``POST /v1/chat/completions`` and ``GET /v1/models`` with the stdlib threading HTTP
server (HTTP/1.1 keep-alive), on 127.0.0.1 and a free port, from a background thread. Every request
is recorded (headers included) so tests can check what each teacher was sent; nothing is logged
beyond the request line.

Faults: ``slow`` (sleep ``seconds``, then answer), ``rate_limit`` (429 with ``Retry-After:
seconds``), ``server_error`` (500), ``malformed_json`` (200 with a body that is not JSON),
``bad_schema`` (200 with JSON lacking ``choices``), ``reset`` (the TCP connection is aborted with
an RST, no response) and, when ``api_key`` is set, a 401 for a missing or wrong bearer token whose
body quotes the presented key as some real APIs do.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import httpx

log = logging.getLogger(__name__)

FaultKind = Literal["slow", "rate_limit", "server_error", "malformed_json", "bad_schema", "reset"]


@dataclass(frozen=True)
class Fault:
    """A misbehaviour for one request. ``seconds`` is the delay for ``slow`` and the Retry-After
    value for ``rate_limit``."""

    kind: FaultKind
    seconds: float = 0.0
    text: str = ""
    """Reply sent after the delay when the script itself returns a ``slow`` fault."""


Answer = str | Fault
Script = Callable[[str, list[dict[str, Any]]], Answer] | Mapping[str, Answer | Callable[[list[dict[str, Any]]], Answer]]
FaultPlan = Mapping[str, Fault | Sequence[Fault | None]]


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it."""

    method: str
    path: str
    headers: httpx.Headers
    """Looked up case-insensitively, as HTTP header names are (the openai SDK sends them in lower
    case)."""
    body: Any
    model: str | None
    messages: list[dict[str, Any]] | None


def count_tokens(text: str) -> int:
    """The fake's token count: whitespace-separated words."""
    return len(text.split())


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens the fake reports for ``messages`` (words in all string contents)."""
    return sum(count_tokens(m["content"]) for m in messages if isinstance(m.get("content"), str))


class FakeOpenAIServer:
    """OpenAI-compatible chat server with scripted answers and per-model, per-request faults.

    ``script``: a function ``(model, messages) -> text | Fault``, or a mapping from model name to a
    text, a Fault, or a function ``messages -> text | Fault``. Unknown models get 404.
    ``faults``: per model, either one Fault applied to every request, or a sequence whose i-th
    entry applies to that model's i-th request (None = answer normally; later requests answer
    normally). A Fault returned by the script applies after those.
    ``api_key``: when set, requests must carry ``Authorization: Bearer <api_key>``.
    ``report_usage``: include token ``usage`` in replies (some OpenAI-compatible servers omit it)."""

    def __init__(
        self,
        script: Script,
        faults: FaultPlan | None = None,
        api_key: str | None = None,
        report_usage: bool = True,
    ):
        self._script = script
        self._faults = dict(faults or {})
        self._api_key = api_key
        self._report_usage = report_usage
        self._lock = threading.Lock()
        self._served: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()
        self._max_in_flight: Counter[str] = Counter()
        self.requests: list[RecordedRequest] = []
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> FakeOpenAIServer:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def chat_requests(self, model: str | None = None) -> list[RecordedRequest]:
        """Recorded chat-completion requests, optionally only those for ``model``."""
        with self._lock:
            return [
                r for r in self.requests
                if r.path.endswith("/chat/completions") and (model is None or r.model == model)
            ]

    def max_in_flight(self, model: str) -> int:
        """Most requests for ``model`` that were being handled at the same time."""
        with self._lock:
            return self._max_in_flight[model]

    def models(self) -> list[str]:
        return list(self._script) if isinstance(self._script, Mapping) else []

    def _record(self, request: RecordedRequest) -> int:
        """Store the request and return how many earlier requests this model received."""
        with self._lock:
            self.requests.append(request)
            model = request.model or ""
            index = self._served[model]
            self._served[model] += 1
            return index

    def _enter(self, model: str) -> None:
        with self._lock:
            self._in_flight[model] += 1
            self._max_in_flight[model] = max(self._max_in_flight[model], self._in_flight[model])

    def _leave(self, model: str) -> None:
        with self._lock:
            self._in_flight[model] -= 1

    def _planned_fault(self, model: str, index: int) -> Fault | None:
        plan = self._faults.get(model)
        if isinstance(plan, Fault):
            return plan
        if plan is not None and index < len(plan):
            return plan[index]
        return None

    def _answer(self, model: str, messages: list[dict[str, Any]]) -> Answer | None:
        if callable(self._script):
            return self._script(model, messages)
        if model not in self._script:
            return None
        entry = self._script[model]
        return entry(messages) if callable(entry) else entry


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the stdlib's 5 drops SYNs when many clients connect at once under load

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Connections aborted on purpose (reset fault) or by a client that timed out end up here.
        log.debug("fake openai: connection from %s ended abruptly", client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fake openai: %s %s", self.command, self.path)

    def do_GET(self) -> None:
        self.fake._record(RecordedRequest("GET", self.path, httpx.Headers(self.headers.items()), None, None, None))
        if self.path.rstrip("/") != "/v1/models":
            return self._send_json(404, {"error": {"message": "not found"}})
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.fake.models()]
        self._send_json(200, {"object": "list", "data": data})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        messages = body.get("messages") if isinstance(body, dict) else None
        headers = httpx.Headers(self.headers.items())
        index = self.fake._record(RecordedRequest("POST", self.path, headers, body, model, messages))
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._send_json(404, {"error": {"message": "not found"}})
        if not isinstance(model, str) or not isinstance(messages, list):
            return self._send_json(400, {"error": {"message": "model and messages are required"}})
        expected = self.fake._api_key
        presented = self.headers.get("Authorization", "")
        if expected is not None and presented != f"Bearer {expected}":
            message = f"Incorrect API key provided: {presented.removeprefix('Bearer ')}"
            return self._send_json(401, {"error": {"message": message, "type": "invalid_request_error"}})
        self.fake._enter(model)
        try:
            self._complete(model, messages, index)
        finally:
            self.fake._leave(model)

    def _complete(self, model: str, messages: list[dict[str, Any]], index: int) -> None:
        answer = self.fake._answer(model, messages)
        if answer is None:
            return self._send_json(404, {"error": {"message": f"model {model} not found"}})
        scripted = answer if isinstance(answer, Fault) else None
        for fault in (self.fake._planned_fault(model, index), scripted):
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.seconds)
            elif fault is not None:
                return self._misbehave(fault)
        text = answer.text if isinstance(answer, Fault) else answer
        completion: dict[str, Any] = {
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }
        if self.fake._report_usage:
            usage_prompt, usage_completion = prompt_tokens(messages), count_tokens(text)
            completion["usage"] = {
                "prompt_tokens": usage_prompt,
                "completion_tokens": usage_completion,
                "total_tokens": usage_prompt + usage_completion,
            }
        self._send_json(200, completion)

    def _misbehave(self, fault: Fault) -> None:
        if fault.kind == "rate_limit":
            self._send_json(429, {"error": {"message": "rate limited"}}, {"Retry-After": f"{fault.seconds:g}"})
        elif fault.kind == "server_error":
            self._send_json(500, {"error": {"message": "internal error"}})
        elif fault.kind == "malformed_json":
            self._send_bytes(200, b'{"choices": [{"message": {"content": "trunc', "application/json")
        elif fault.kind == "bad_schema":
            self._send_json(200, {"object": "chat.completion", "result": "no choices here"})
        elif fault.kind == "reset":
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

    def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (e.g. timed out)
            self.close_connection = True
