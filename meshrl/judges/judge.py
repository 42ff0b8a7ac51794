"""An LLM judge: ``Judge(cfg).score(task, transcript, answer) -> JudgeResult``, or ``await
judge.ascore(...)`` from any event loop.

Calls go through the teacher client (``meshrl.teachers.client``: timeouts per attempt, retries with
backoff, typed errors, a spend meter with a budget) on an event loop of the judge's own, in a
background thread, so that synchronous callers (the env processes' episode threads) and async ones
share one client and one cache. Every judgment ends within ``deadline_s``: it yields a reward in
[0, 1] or a failure, never an exception.

Counters (``metrics()``): ``judge/judgments``, ``judge/calls`` (requests sent), ``judge/cache_hits``,
``judge/retries``, ``judge/malformed``, ``judge/timeouts``, ``judge/errors``,
``judge/budget_exhausted``, ``judge/truncated``, ``judge/defused`` and the spend
(``judge/spend_prompt_tokens``, ``judge/spend_completion_tokens``, ``judge/spend_usd``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from meshrl.config.judge import JudgeConfig
from meshrl.judges.rubric import MalformedReply, build_prompt, normalise, parse_score
from meshrl.teachers.client import SpendMeter, TeacherClient, TeacherError

log = logging.getLogger(__name__)

Failure = Literal["malformed", "timeout", "error", "budget_exhausted"]

FAILURE_COUNTERS: dict[str, str] = {"malformed": "judge/malformed", "timeout": "judge/timeouts",
                                    "error": "judge/errors", "budget_exhausted": "judge/budget_exhausted"}

COUNTERS = ("judge/judgments", "judge/calls", "judge/cache_hits", "judge/truncated", "judge/defused",
            *FAILURE_COUNTERS.values())
"""The counters ``metrics()`` always reports (0 until counted)."""

LOOP_GRACE_S = 10.0
"""How much longer than ``deadline_s`` a synchronous caller waits for the judge's loop itself."""

REPLY_QUOTE_CHARS = 120
"""How much of a malformed reply a log line quotes."""


@dataclass(frozen=True)
class JudgeResult:
    """One judgment: a reward in [0, 1], or why there is none."""

    reward: float | None
    """The score normalised to [0, 1]; None when the judgment failed."""
    raw_score: float | None = None
    """The score as the judge wrote it."""
    failure: Failure | None = None
    detail: str = ""
    """One line saying why the judgment failed."""
    cached: bool = False
    """The judgment of an identical earlier (or concurrent) request."""
    reply: str = ""
    """The judge's reply text."""

    @property
    def ok(self) -> bool:
        return self.failure is None


class Judge:
    """Scores (task, transcript, answer) with the configured judge model; see the module docstring."""

    def __init__(self, cfg: JudgeConfig, meter: SpendMeter | None = None):
        self.cfg = cfg
        self.meter = meter if meter is not None else SpendMeter(budget_usd=cfg.budget_usd)
        self.client = TeacherClient(cfg.endpoint, self.meter)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._cache: OrderedDict[str, asyncio.Future] = OrderedDict()  # touched only on the loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"judge-{cfg.endpoint.name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Judge({self.client!r})"

    # ---- the API -------------------------------------------------------------------------------
    def score(self, task: str, transcript: list[dict[str, Any]], answer: str) -> JudgeResult:
        """Judge one episode, blocking; call it from any thread but the judge's own."""
        future = asyncio.run_coroutine_threadsafe(self._judgment(task, transcript, answer), self._loop)
        try:
            return future.result(timeout=self.cfg.deadline_s + LOOP_GRACE_S)
        except cf.TimeoutError:  # the loop itself is stuck: the judgment is given up all the same
            future.cancel()
            return self._failed(JudgeResult(None, failure="timeout", detail="the judge's event loop did not answer"))

    def score_many(self, items: list[tuple[str, list[dict[str, Any]], str]]) -> list[JudgeResult]:
        """Judge several (task, transcript, answer) at once, concurrently (up to the endpoint's
        ``max_concurrency`` in flight), all within one ``deadline_s``; results in order."""
        if not items:
            return []

        async def all_of() -> list[JudgeResult]:
            return list(await asyncio.gather(*(self._judgment(*item) for item in items)))

        future = asyncio.run_coroutine_threadsafe(all_of(), self._loop)
        try:
            return future.result(timeout=self.cfg.deadline_s + LOOP_GRACE_S)
        except cf.TimeoutError:
            future.cancel()
            stuck = JudgeResult(None, failure="timeout", detail="the judge's event loop did not answer")
            return [self._failed(stuck) for _ in items]

    async def ascore(self, task: str, transcript: list[dict[str, Any]], answer: str) -> JudgeResult:
        """``score`` for async callers (on any event loop)."""
        future = asyncio.run_coroutine_threadsafe(self._judgment(task, transcript, answer), self._loop)
        return await asyncio.wrap_future(future)

    def metrics(self) -> dict[str, float]:
        """The counters and the spend so far (totals since this judge started)."""
        with self._counts_lock:
            out = {k: float(self._counts[k]) for k in COUNTERS}
        spend = self.meter.by_teacher.get(self.cfg.endpoint.name)
        out["judge/retries"] = float(self.client.counts["retries"])
        out["judge/spend_prompt_tokens"] = float(spend.prompt_tokens if spend else 0)
        out["judge/spend_completion_tokens"] = float(spend.completion_tokens if spend else 0)
        out["judge/spend_usd"] = spend.cost_usd if spend else 0.0
        return out

    def close(self) -> None:
        """Close the client and stop the judge's loop."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result(timeout=LOOP_GRACE_S)
        except (cf.TimeoutError, RuntimeError) as e:
            log.debug("closing the judge's client failed: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=LOOP_GRACE_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- on the judge's loop -------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        if n:
            with self._counts_lock:
                self._counts[key] += n

    def _failed(self, result: JudgeResult) -> JudgeResult:
        self._count(FAILURE_COUNTERS[result.failure])
        return result

    async def _judgment(self, task: str, transcript: list[dict[str, Any]], answer: str) -> JudgeResult:
        cfg = self.cfg
        self._count("judge/judgments")
        prompt = build_prompt(cfg.rubric, cfg.system, task, transcript, answer, cfg.max_transcript_chars)
        self._count("judge/truncated", prompt.truncated)
        self._count("judge/defused", prompt.defused)
        try:
            result = await asyncio.wait_for(self._cached(prompt.messages), timeout=cfg.deadline_s)
        except asyncio.TimeoutError:
            result = JudgeResult(None, failure="timeout", detail=f"no judgment within judge.deadline_s={cfg.deadline_s:g}s")
        if result.ok:
            return result
        log.warning("judge %s: %s: %s", cfg.endpoint.name, result.failure, result.detail)
        return self._failed(result)

    async def _cached(self, messages: list[dict[str, str]]) -> JudgeResult:
        """The judgment of ``messages``: a cached or in-flight one for an identical request, or a new one.
        Failures are not kept (a timeout or an error may not happen again)."""
        if self.cfg.cache_size == 0:
            return await self._ask(messages)
        key = hashlib.sha256(json.dumps([self.cfg.endpoint.model, messages], ensure_ascii=False).encode()).hexdigest()
        pending = self._cache.get(key)
        if pending is not None:
            self._cache.move_to_end(key)
            self._count("judge/cache_hits")
            return dataclasses.replace(await asyncio.shield(pending), cached=True)
        pending = self._loop.create_future()
        self._cache[key] = pending
        while len(self._cache) > self.cfg.cache_size:
            self._cache.popitem(last=False)
        try:
            result = await self._ask(messages)
        except asyncio.CancelledError:  # its deadline passed: those waiting on it fail the same way
            result = JudgeResult(None, failure="timeout", detail="an identical judgment in flight timed out")
            self._forget(key, pending)
            pending.set_result(result)
            raise
        if not result.ok:
            self._forget(key, pending)
        pending.set_result(result)
        return result

    def _forget(self, key: str, pending: asyncio.Future) -> None:
        if self._cache.get(key) is pending:
            del self._cache[key]

    async def _ask(self, messages: list[dict[str, str]]) -> JudgeResult:
        cfg = self.cfg
        self._count("judge/calls")
        try:
            reply = await self.client.chat(messages)
        except TeacherError as e:
            failure: Failure = ("timeout" if e.kind == "timeout" else
                                "budget_exhausted" if e.kind == "budget_exhausted" else "error")
            return JudgeResult(None, failure=failure, detail=str(e))
        try:
            raw = parse_score(reply.text, cfg.score_format, cfg.json_field)
            reward = normalise(raw, cfg.scale_min, cfg.scale_max)
        except MalformedReply as e:
            return JudgeResult(None, failure="malformed", reply=reply.text,
                               detail=f"{e} (reply: {reply.text[-REPLY_QUOTE_CHARS:]!r})")
        return JudgeResult(reward, raw_score=raw, reply=reply.text)
