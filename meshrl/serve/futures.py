"""Results the SDK polls for with `retrieve_future`.

Every submitting endpoint answers at once with a request id; the work runs on the backend and its
outcome is settled here, exactly once: a protobuf payload (forward_backward and sample results,
which the SDK only accepts as protobuf), a JSON payload (everything else) or a failure with the
SDK's error category (`user` for a `UserError`, `server` for anything else). A poll waits up to
the hold time for a pending request; a settled result stays retrievable for the TTL, so a poll
repeated after a lost reply still finds it.

Everything here runs on the server's event loop; `run_on` and `then` compose backend futures on
worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Literal

from meshrl.api.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProtoResult:
    """A result sent as `application/x-protobuf`."""

    payload: bytes


@dataclass(frozen=True)
class JsonResult:
    """A result sent as JSON."""

    payload: dict[str, Any]


@dataclass(frozen=True)
class FailedResult:
    """A failed request, sent as ``{"error": message, "category": category}``."""

    message: str
    category: Literal["user", "server"]


Outcome = ProtoResult | JsonResult | FailedResult


# an absolute filesystem path (not the host or path of a tinker:// or http:// address)
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s/'\"]+/)*[^\s/'\"]+")


def one_line(message: str) -> str:
    """What a client may read of an error: its first line (no traceback), absolute paths of this
    machine replaced by ``<path>``."""
    first = next((line.strip() for line in message.strip().splitlines() if line.strip()), "")
    return _ABSOLUTE_PATH.sub("<path>", first)


def failure(exc: BaseException) -> FailedResult:
    """The outcome of a request that raised ``exc``, in one line without paths (`one_line`): a
    `UserError` is the client's; anything else the server's, named by its type, with an error id
    under which the server's log keeps the whole error and its traceback."""
    if isinstance(exc, UserError):
        return FailedResult(one_line(str(exc)), "user")
    error_id = uuid.uuid4().hex[:12]
    log.error("server error %s: %s", error_id, type(exc).__name__, exc_info=exc)
    return FailedResult(f"{type(exc).__name__}: {one_line(str(exc))} (server error {error_id}: the server's log has "
                        "the details)", "server")


@dataclass
class _Entry:
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    settled_at: float = 0.0
    owner: str | None = None  # the tenant the request id was returned to


class FutureStore:
    """Pending and settled requests by id, on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, result_ttl_s: float, request_timeout_s: float):
        self._loop = loop
        self._ttl_s = result_ttl_s
        self._timeout_s = request_timeout_s
        self._entries: dict[str, _Entry] = {}

    def create(self) -> str:
        """A new pending request id (and forget results past their TTL)."""
        self._forget_expired()
        request_id = uuid.uuid4().hex
        self._entries[request_id] = _Entry()
        return request_id

    def claim(self, request_id: str, owner: str) -> None:
        """Record the tenant a request id was returned to (the first one, if it is returned again
        to a retry)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.owner is None:
            entry.owner = owner

    def owner(self, request_id: str) -> str | None:
        """The tenant a request id was returned to; None if unknown or forgotten."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.owner

    def settle(self, request_id: str, outcome: Outcome) -> None:
        """Record the outcome of a pending request; later outcomes for it are ignored (a request
        that timed out and then finished keeps its timeout)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome = outcome
        entry.settled_at = time.monotonic()
        entry.settled.set()

    def track(self, request_id: str, future: Future, encode: Callable[[Any], Outcome]) -> None:
        """Settle ``request_id`` with ``encode(result)`` (run on the event loop, so it may update
        the server's state) when the backend ``future`` completes, with its failure if it raises,
        or with a server error if it has not completed within the request timeout."""
        deadline = self._loop.call_later(
            self._timeout_s, self.settle, request_id,
            FailedResult(f"the backend did not finish within serve.request_timeout_s = {self._timeout_s:g} s",
                         "server"))

        def complete(done: Future) -> None:
            deadline.cancel()
            try:
                outcome = encode(_value(done))
            except Exception as exc:  # noqa: BLE001 - every failure becomes the request's outcome
                outcome = failure(exc)
            self.settle(request_id, outcome)

        def completed(done: Future) -> None:
            if not self._loop.is_closed():  # else the server has stopped: nobody is waiting
                self._loop.call_soon_threadsafe(complete, done)

        future.add_done_callback(completed)

    async def wait(self, request_id: str, hold_s: float) -> Outcome | None:
        """The outcome of ``request_id`` once settled, or None if it is still pending after
        ``hold_s``. Raises KeyError for an id that is unknown or forgotten."""
        entry = self._entries[request_id]
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.settled.wait(), hold_s)
            except asyncio.TimeoutError:
                return None
        return entry.outcome

    def _forget_expired(self) -> None:
        cutoff = time.monotonic() - self._ttl_s
        expired = [rid for rid, e in self._entries.items() if e.outcome is not None and e.settled_at < cutoff]
        for rid in expired:
            del self._entries[rid]


def run_on(executor: Executor, call: Callable[[], Future]) -> Future:
    """The future that ``call()`` returns, with ``call`` itself run on ``executor`` (a backend's
    submitting call may block; one single-thread executor per model keeps submissions in order)."""
    out: Future = Future()

    def submitted(outer: Future) -> None:
        try:
            _value(outer).add_done_callback(lambda inner: _relay(inner, out))
        except Exception as exc:  # noqa: BLE001 - the submission itself failed
            out.set_exception(exc)

    executor.submit(call).add_done_callback(submitted)
    return out


def then(future: Future, step: Callable[[Any], Any], executor: Executor) -> Future:
    """A future of ``step(result)``, run on ``executor`` once ``future`` succeeds."""
    out: Future = Future()

    def first_done(done: Future) -> None:
        try:
            value = _value(done)
        except Exception as exc:  # noqa: BLE001 - relayed to the caller's future
            out.set_exception(exc)
            return
        executor.submit(step, value).add_done_callback(lambda second: _relay(second, out))

    future.add_done_callback(first_done)
    return out


def _value(done: Future) -> Any:
    """The result of a completed future; a cancelled one raises a RuntimeError (not the
    CancelledError BaseException, which would escape the handlers)."""
    if done.cancelled():
        raise RuntimeError("the backend cancelled the operation")
    return done.result()


def _relay(source: Future, target: Future) -> None:
    try:
        target.set_result(_value(source))
    except Exception as exc:  # noqa: BLE001 - relayed to the caller's future
        target.set_exception(exc)
