"""Async client for one OpenAI-compatible chat endpoint, built on the official ``openai`` SDK
(``AsyncOpenAI``: transport, typed errors, response parsing), with bounded concurrency, retries
with exponential backoff and full jitter, Retry-After, typed errors, outcome counters and a shared
spend budget.

Retries are ours, not the SDK's (it runs with ``max_retries=0``): its backoff starts at 0.5 s and
is capped at 8 s by module constants with at most 25 % jitter, it waits out any Retry-After up to
120 s (and gives up past that), and it also retries 408/409; none of that can be set to
``backoff_base_s``, ``backoff_max_s`` or ``jitter``. Retrying in our loop also frees the
concurrency slot during a backoff, re-checks the spend budget before every attempt, and counts the
attempts and retries of each call.

The API key is read from the configured environment variable for every attempt, sent only in that
request's Authorization header, and kept out of logs, exception texts and reprs: response bodies
are redacted before they are quoted, and the SDK's exceptions, whose messages quote bodies
unredacted, are neither quoted nor chained to ours. The SDK's ambient credentials never reach a
teacher: it gets a placeholder instead of ``OPENAI_API_KEY``, and the organization and project ids
it would take from ``OPENAI_ORG_ID`` and ``OPENAI_PROJECT_ID`` are left out of every request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

from meshrl.config.teachers import TeacherEndpointConfig

log = logging.getLogger(__name__)

ErrorKind = Literal[
    "timeout",
    "rate_limited",
    "server_error",
    "connection",
    "malformed_json",
    "bad_schema",
    "bad_request",
    "auth",
    "budget_exhausted",
]
RETRYABLE: frozenset[str] = frozenset({"timeout", "rate_limited", "server_error", "connection"})
"""Error kinds worth another attempt; the others would fail the same way again (or cost money)."""

BODY_QUOTE_CHARS = 200
"""How much of an unexpected response body an error message quotes (after redaction)."""


class TeacherError(Exception):
    """A teacher call that produced no usable reply. ``kind`` says why (see ``ErrorKind``)."""

    def __init__(self, kind: ErrorKind, teacher: str, detail: str, attempts: int = 0):
        super().__init__(f"teacher {teacher}: {kind}: {detail} (after {attempts} attempt(s))")
        self.kind = kind
        self.teacher = teacher
        self.detail = detail
        self.attempts = attempts


@dataclass(frozen=True)
class TeacherReply:
    """A successful chat completion."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    attempts: int
    latency_s: float


@dataclass
class Spend:
    """Tokens and cost accumulated by some set of calls."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, prompt_tokens: int, completion_tokens: int, cost_usd: float) -> None:
        self.calls += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd


@dataclass
class SpendMeter:
    """Spend shared by several clients: totals per teacher and overall, and a USD budget.

    Once ``total.cost_usd`` reaches ``budget_usd`` (> 0), calls fail fast with ``budget_exhausted``.
    Calls already in flight when the budget runs out still complete and are recorded, so the
    overshoot is bounded by the cost of the calls in flight."""

    budget_usd: float = 0.0
    total: Spend = field(default_factory=Spend)
    by_teacher: dict[str, Spend] = field(default_factory=dict)
    rejected_calls: int = 0
    carried_usd: float = 0.0
    """Spend charged by ``carry_over`` (included in ``total.cost_usd``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def exhausted(self) -> bool:
        return self.budget_usd > 0 and self.total.cost_usd >= self.budget_usd

    def admit(self) -> bool:
        """True if a new call may start; otherwise counts the rejection."""
        with self._lock:
            if not self.exhausted:
                return True
            if self.rejected_calls == 0:
                log.warning(
                    "spend budget of $%.4f used up ($%.4f spent): teacher calls now fail fast",
                    self.budget_usd, self.total.cost_usd,
                )
            self.rejected_calls += 1
            return False

    def carry_over(self, cost_usd: float) -> None:
        """Charge spend made before this meter existed (by a process this one replaces), so a
        replacement does not start with a fresh budget."""
        with self._lock:
            self.total.cost_usd += cost_usd
            self.carried_usd += cost_usd

    def record(self, teacher: str, prompt_tokens: int, completion_tokens: int, cost_usd: float) -> None:
        with self._lock:
            self.total.add(prompt_tokens, completion_tokens, cost_usd)
            self.by_teacher.setdefault(teacher, Spend()).add(prompt_tokens, completion_tokens, cost_usd)


class _AttemptFailed(Exception):
    def __init__(self, kind: ErrorKind, detail: str, retry_after_s: float | None = None):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.retry_after_s = retry_after_s


SDK_PLACEHOLDER_KEY = "per-request"
"""The client-wide key the SDK insists on. Ours is read for every attempt and sent in that request's
own Authorization header (or that header is omitted), which overrides this one: it is never sent."""


def _request_headers(key: str) -> dict[str, str | openai.Omit]:
    """Headers of one request: the key (no Authorization header at all without one), and none of the
    ids the SDK would add from ``OPENAI_ORG_ID`` and ``OPENAI_PROJECT_ID``."""
    return {
        "Authorization": f"Bearer {key}" if key else openai.omit,
        "OpenAI-Organization": openai.omit,
        "OpenAI-Project": openai.omit,
    }


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text


def _retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None
    return max(0.0, seconds) if seconds is not None else None


def _status_kind(error: openai.APIStatusError) -> ErrorKind:
    if isinstance(error, openai.RateLimitError):
        return "rate_limited"
    if isinstance(error, openai.InternalServerError) or error.status_code >= 500:
        return "server_error"
    if isinstance(error, (openai.AuthenticationError, openai.PermissionDeniedError)):
        return "auth"
    return "bad_request"  # BadRequestError, NotFoundError, UnprocessableEntityError and any other 4xx


def _failure(error: openai.APIStatusError | openai.APIConnectionError, key: str) -> _AttemptFailed:
    """What an SDK exception other than a timeout means for the attempt. The SDK's own message is
    not used: it may quote a response body that quotes the key."""
    if isinstance(error, openai.APIStatusError):
        kind = _status_kind(error)
        quoted = _redact(error.response.text[:BODY_QUOTE_CHARS], key)
        retry_after = _retry_after_seconds(error.response.headers) if kind == "rate_limited" else None
        return _AttemptFailed(kind, f"HTTP {error.status_code}: {quoted}", retry_after)
    cause = error.__cause__ or error  # the transport's exception, e.g. ConnectError or ReadError
    reason = _redact(str(cause), key)
    name = type(cause).__name__
    return _AttemptFailed("connection", f"{name}: {reason}" if reason else name)


def _not_json(body: str, key: str) -> _AttemptFailed:
    quoted = _redact(body[:BODY_QUOTE_CHARS], key)
    return _AttemptFailed("malformed_json", f"response is not JSON: {quoted!r}")


def _estimate_tokens(text: str) -> int:
    """Rough token count (4 characters per token) for endpoints that report no usage."""
    return (len(text) + 3) // 4


class TeacherClient:
    """Chat client for one teacher endpoint: ``await client.chat(messages)``.

    ``counts`` holds one entry per finished call under its outcome (``ok`` or an error kind), plus
    ``retries`` (extra attempts made) and ``usage_estimated`` (replies without token usage)."""

    def __init__(self, cfg: TeacherEndpointConfig, meter: SpendMeter | None = None):
        self.cfg = cfg
        self.meter = meter if meter is not None else SpendMeter()
        self.counts: Counter[str] = Counter()
        self._semaphore = asyncio.Semaphore(cfg.max_concurrency)
        # Concurrency is limited by the semaphore, not the SDK's connection pool, so that time
        # spent waiting for a slot does not count against a request's timeout.
        self._openai = openai.AsyncOpenAI(
            base_url=cfg.base_url,
            api_key=SDK_PLACEHOLDER_KEY,
            timeout=cfg.timeout_s,
            max_retries=0,  # retries are ours (see the module docstring)
        )

    def __repr__(self) -> str:
        return f"TeacherClient(name={self.cfg.name!r}, model={self.cfg.model!r}, base_url={self.cfg.base_url!r})"

    @property
    def name(self) -> str:
        return self.cfg.name

    async def aclose(self) -> None:
        await self._openai.close()

    async def __aenter__(self) -> TeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def chat(self, messages: list[dict[str, Any]]) -> TeacherReply:
        """Send ``messages`` unchanged and return the reply, or raise ``TeacherError``."""
        try:
            reply = await self._chat_with_retries(messages)
        except TeacherError as e:
            self.counts[e.kind] += 1
            # budget rejections are announced once by the meter, not once per call
            log.log(logging.DEBUG if e.kind == "budget_exhausted" else logging.WARNING, "%s", e)
            raise
        self.counts["ok"] += 1
        return reply

    async def _chat_with_retries(self, messages: list[dict[str, Any]]) -> TeacherReply:
        cfg = self.cfg
        started = time.monotonic()
        attempts = 0
        while True:
            key = self._api_key(attempts)
            try:
                async with self._semaphore:
                    # checked once a slot is free, so calls queued behind the limit see recent spend
                    if not self.meter.admit():
                        raise TeacherError("budget_exhausted", cfg.name, "spend budget used up", attempts)
                    attempts += 1
                    text, prompt_tokens, completion_tokens = await self._attempt(messages, key)
            except _AttemptFailed as failure:
                if failure.kind not in RETRYABLE or attempts > cfg.max_retries:
                    raise TeacherError(failure.kind, cfg.name, failure.detail, attempts) from None
                delay = self._backoff_s(attempts, failure.retry_after_s)
                self.counts["retries"] += 1
                log.info(
                    "teacher %s: %s on attempt %d/%d, retrying in %.2fs",
                    cfg.name, failure.kind, attempts, cfg.max_retries + 1, delay,
                )
                await asyncio.sleep(delay)
                continue
            cost = (
                prompt_tokens * cfg.price_prompt_per_1m_usd
                + completion_tokens * cfg.price_completion_per_1m_usd
            ) / 1e6
            self.meter.record(cfg.name, prompt_tokens, completion_tokens, cost)
            return TeacherReply(
                text=text,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cost_usd=cost,
                attempts=attempts,
                latency_s=time.monotonic() - started,
            )

    def _api_key(self, attempts: int) -> str:
        env = self.cfg.api_key_env
        if not env:
            return ""
        key = os.environ.get(env, "")
        if not key:
            raise TeacherError("auth", self.cfg.name, f"environment variable {env} is not set", attempts)
        return key

    def _backoff_s(self, attempt: int, retry_after_s: float | None) -> float:
        cfg = self.cfg
        if retry_after_s is not None:
            return min(retry_after_s, cfg.backoff_max_s)
        ceiling = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1))
        return random.uniform(0.0, ceiling) if cfg.jitter else ceiling

    async def _attempt(self, messages: list[dict[str, Any]], key: str) -> tuple[str, int, int]:
        cfg = self.cfg
        call = self._openai.chat.completions.create(
            model=cfg.model,
            messages=messages,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            extra_headers=_request_headers(key),
        )
        try:
            # the SDK's timeout bounds each phase (connect, every read); this bounds the attempt
            completion = await asyncio.wait_for(call, timeout=cfg.timeout_s)
        except (asyncio.TimeoutError, openai.APITimeoutError):
            failure = _AttemptFailed("timeout", f"no response within {cfg.timeout_s:g}s")
        except (openai.APIStatusError, openai.APIConnectionError) as e:
            failure = _failure(e, key)
        except json.JSONDecodeError as e:  # a body declared as JSON that is not
            failure = _not_json(e.doc, key)
        except UnicodeDecodeError as e:
            failure = _not_json(e.object.decode("utf-8", errors="replace"), key)
        else:
            if isinstance(completion, str):  # the SDK returns any other body it cannot parse as text
                raise _not_json(completion, key)
            return self._read_completion(completion, messages)
        raise failure  # outside the except clauses, so that the SDK's exception is not chained to it

    def _read_completion(self, completion: Any, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
        """Text and token counts of a parsed reply. The SDK builds it without validation, so any
        part may be missing or of another type (a JSON body that is not an object is returned as
        is): only the fields used here are checked."""
        try:
            text = completion.choices[0].message.content
        except (AttributeError, IndexError, KeyError, TypeError):
            raise _AttemptFailed("bad_schema", "no choices[0].message.content in the response") from None
        if not isinstance(text, str):
            raise _AttemptFailed("bad_schema", f"message content is {type(text).__name__}, not a string")
        prompt_tokens = getattr(completion.usage, "prompt_tokens", None)
        completion_tokens = getattr(completion.usage, "completion_tokens", None)
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            return text, prompt_tokens, completion_tokens
        self.counts["usage_estimated"] += 1
        prompt_chars = json.dumps(messages, ensure_ascii=False)
        return text, _estimate_tokens(prompt_chars), _estimate_tokens(text)
