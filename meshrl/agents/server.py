"""The agent endpoint: OpenAI's `POST /v1/chat/completions` (and `GET /v1/models`) on loopback HTTP,
one thread per request, each completion sampled by the function the rollout strategy gives
(the generator mesh, pinned to the step's policy version).

Requests are routed to episodes by their API key (`Authorization: Bearer <key>`; each episode's
program gets its own): an unknown key is refused (401), a request of an episode that is over (409)
or out of completions (429), an invalid one is refused with 400 naming the field. Every completion
served is recorded in its episode's `EpisodeLog`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from meshrl.agents.requests import BadRequest, check_fits, parse_body, validate
from meshrl.agents.transcript import EpisodeLog, ServedCall, plain, render_prompt, reply_tokens
from meshrl.agents.wire import completion_body, error_body, logprobs_content
from meshrl.engines import Completion
from meshrl.renderers import Renderer
from meshrl.renderers.tools import ToolCall, ToolCallError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
Sampler = Callable[[str, int, list[int], int, int], Completion]
"""``sample(episode key, call index, prompt tokens, max_tokens, top_logprobs)`` -> the completion."""


class AgentEndpoint:
    """What the endpoint serves, without HTTP: the episodes by key, validation, rendering with
    substitution, sampling and recording. ``counts``: `rejected` (4xx answers), `sample_errors`,
    `malformed_tool_calls` (replies to requests with tools whose calls could not be parsed: served as
    plain text)."""

    def __init__(self, renderer: Renderer, sample: Sampler, max_new_tokens: int, max_model_len: int):
        self.renderer, self.sample = renderer, sample
        self.max_new_tokens, self.max_model_len = max_new_tokens, max_model_len
        self.episodes: dict[str, EpisodeLog] = {}
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def open(self, key: str, episode: EpisodeLog) -> None:
        self.episodes[key] = episode

    def handle(self, key: str | None, raw: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON body) of one request with API key ``key``."""
        try:
            return 200, self._serve(key, raw)
        except BadRequest as e:
            with self._lock:
                self.counts["rejected" if e.status < 500 else "sample_errors"] += 1
            return e.status, error_body(str(e), e.param, e.status)

    def _serve(self, key: str | None, raw: bytes) -> dict:
        episode = self.episodes.get(key or "")
        if episode is None:
            raise BadRequest(None, "unknown API key: use the OPENAI_API_KEY meshrl gave this episode", 401)
        request = validate(parse_body(raw), self.max_new_tokens)
        prompt = render_prompt(self.renderer, request.messages, episode.served(), request.tools)
        check_fits(len(prompt), request.max_tokens, self.max_model_len)
        index = episode.admit()
        if index is None:
            if episode.closed:
                raise BadRequest(None, "this episode is over: its program's run has ended", 409)
            raise BadRequest(None, f"this episode has used its {episode.max_calls} completions "
                             "(task.agent.max_completions)", 429)
        try:
            c = self.sample(key, index, prompt, request.max_tokens, request.top_logprobs)
        except Exception as e:  # noqa: BLE001 - the generator failed this request: the agent is told
            log.warning("agent endpoint: sampling failed: %s", e)
            raise BadRequest(None, f"sampling failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                             503) from None
        content = reply_tokens(self.renderer, c.tokens)
        text = self.renderer.tokenizer.decode(content, skip_special_tokens=False)
        text, tool_calls = self._tool_calls(text, index) if request.tools else (text, ())
        version = int(c.meta["version"])
        call = ServedCall(plain(request.messages), prompt, list(c.tokens), list(c.logprobs), text, c.finish_reason, version,
                          tool_calls)
        if not episode.record(call):
            raise BadRequest(None, "this episode is over: its program's run ended while the completion was sampled", 409)
        logprobs = logprobs_content(self.renderer.tokenizer, c, content, request.top_logprobs) if request.logprobs else None
        return completion_body(f"chatcmpl-{key[:8]}-{index}", request.model, text, c.finish_reason, len(prompt),
                               len(c.tokens), version, logprobs, tool_calls)

    def _tool_calls(self, text: str, index: int) -> tuple[str, tuple[ToolCall, ...]]:
        """(content, calls) of a reply to a request with tools, each call's id unique in the episode;
        a reply whose calls cannot be parsed is plain text (counted)."""
        try:
            content, calls = self.renderer.parse_tool_calls(text)
        except ToolCallError:
            with self._lock:
                self.counts["malformed_tool_calls"] += 1
            return text, ()
        if not calls:
            return text, ()
        return content, tuple(ToolCall(c.name, c.arguments, f"call_{index}_{j}") for j, c in enumerate(calls))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # every episode of a batch may connect at once (the default backlog is 5)


class AgentServer:
    """`endpoint` served on 127.0.0.1 (an ephemeral port) by a thread until `close()`."""

    def __init__(self, endpoint: AgentEndpoint, request_timeout_s: float = 30.0):
        handler = _handler(endpoint, request_timeout_s)
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> "AgentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handler(endpoint: AgentEndpoint, request_timeout_s: float) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout_s  # a client that stalls mid-request is dropped
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # requests are counted, not logged one by one
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/v1/models":
                self._reply(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "meshrl"}]})
            else:
                self._reply(404, error_body(f"no such path {self.path}", None, 404))

        def do_POST(self) -> None:  # noqa: N802
            length = self.headers.get("Content-Length")
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._reply(404, error_body(f"no such path {self.path}: POST /v1/chat/completions", None, 404))
                return
            if length is None or not length.isdigit() or int(length) > MAX_BODY_BYTES:
                self.close_connection = True
                self._reply(413, error_body(f"the body must have a Content-Length of at most {MAX_BODY_BYTES} bytes",
                                            None, 413))
                return
            raw = self.rfile.read(int(length))
            auth = self.headers.get("Authorization", "")
            key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None
            try:
                status, body = endpoint.handle(key, raw)
            except Exception as e:  # noqa: BLE001 - a fault of the endpoint's own: logged, answered 500
                log.exception("agent endpoint: request failed")
                status, body = 500, error_body(f"internal error: {type(e).__name__}", None, 500)
            self._reply(status, body)

    return Handler
