"""A small cooperative step driver: code that waits on Monarch futures is written once as a step
generator that yields what it waits for (``_Await`` one future, ``_AwaitAll`` several, ``_Sleep``,
``_Run`` a blocking local function) and receives the result (or the exception); ``_drive`` runs it
from synchronous code with ``Future.get``, ``_adrive`` from a coroutine with ``await``. The weight
store uses it so that its sync and ``a``-prefixed async methods share one implementation."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator


@dataclass
class _Await:
    """Wait for one future; the step generator receives its result or the raised exception
    (``TimeoutError`` after ``timeout_s``)."""

    future: Any
    timeout_s: float


@dataclass
class _AwaitAll:
    """Wait for every future (common deadline); the generator receives a list with each result or
    exception instance, never a raise."""

    futures: list
    timeout_s: float


@dataclass
class _Sleep:
    seconds: float


@dataclass
class _Run:
    """Call a blocking local function (a memory copy): inline from sync code, in a worker thread from
    a coroutine so the event loop keeps serving; the generator receives its result or exception."""

    fn: Callable[[], Any]


Steps = Generator[Any, Any, Any]


def _drive(steps: Steps) -> Any:
    """Run a step generator from synchronous code with ``Future.get``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("the sync weight-store API blocks the event loop; use the 'a'-prefixed coroutine")
    value, error = None, None
    while True:
        try:
            request = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(request, _Await):
                value = request.future.get(timeout=request.timeout_s)
            elif isinstance(request, _AwaitAll):
                deadline = time.monotonic() + request.timeout_s
                value = [_settle(f, max(deadline - time.monotonic(), 0.001)) for f in request.futures]
            elif isinstance(request, _Run):
                value = request.fn()
            else:
                time.sleep(request.seconds)
        except Exception as e:
            error = e


def _settle(future: Any, timeout_s: float) -> Any:
    try:
        return future.get(timeout=timeout_s)
    except Exception as e:
        return e


async def _adrive(steps: Steps) -> Any:
    """Run a step generator from a coroutine with ``await``."""
    value, error = None, None
    while True:
        try:
            request = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(request, _Await):
                value = await _await_with_timeout(request.future, request.timeout_s)
            elif isinstance(request, _AwaitAll):
                value = await asyncio.gather(
                    *(_await_with_timeout(f, request.timeout_s) for f in request.futures), return_exceptions=True
                )
            elif isinstance(request, _Run):
                value = await asyncio.to_thread(request.fn)
            else:
                await asyncio.sleep(request.seconds)
        except Exception as e:
            error = e


async def _await_with_timeout(future: Any, timeout_s: float) -> Any:
    async def wait() -> Any:
        return await future

    try:
        return await asyncio.wait_for(wait(), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g}s") from None


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
