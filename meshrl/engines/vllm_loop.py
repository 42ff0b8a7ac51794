"""The thread that owns an in-process vLLM engine and steps it: continuous batching.

vLLM's scheduler admits waiting requests into the running batch at every engine step, each
request with its own `SamplingParams` (seed, temperature, stop tokens, length). `LLM.generate`
feeds it one batch and steps until the whole batch is done, so a request that arrives meanwhile
waits for all of it. This loop adds each request the moment it is submitted (`LLMEngine.add_request`)
and calls `LLMEngine.step()` while anything runs: a request that arrives while others generate
joins at the next step and its future completes as soon as it is done. vLLM's `AsyncLLM` does the
same, but always in an engine process of its own, out of reach of the in-place weight reload
(`collective_rpc("reload_weights")` with tensors of this process).

One thread does everything that touches the engine (building it, stepping, adding requests, and
the calls given to `call`, such as weight reloads), so nothing runs beside a step, and the CPU
worker's OpenMP threads, bound when the engine is built, stay those of the thread that computes.

`paused()`: while any caller is inside it, no request is admitted; entering waits until the
requests already admitted have finished (under the weights they started with). Requests submitted
meanwhile wait and are admitted when the last pause ends, in submission order. Weight updates
run inside a pause, so weights never change under a running request.

A step that raises leaves the engine unusable: every request in flight and every later one fails
with `EngineFailed` (the generator that owns it is then replaced by the supervisor).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class EngineFailed(RuntimeError):
    """The engine raised during a step (or was closed) and serves nothing more."""


@dataclass
class _Request:
    prompt: list[int]
    params: Any
    future: Future
    lora: Any = None
    """The request's `LoRARequest` (None: the engine's own weights)."""


class EngineLoop:
    """``build()`` (a `vllm.LLM`) made and stepped on a thread of its own. With ``sleeps`` the
    engine is put to sleep whenever it falls idle (co-located with a learner on a GPU) and woken
    before it next works."""

    def __init__(self, build: Callable[[], Any], sleeps: bool = False, name: str = "vllm-engine"):
        self._cond = threading.Condition()
        self._pending: list[_Request] = []  # submitted, not yet admitted
        self._jobs: list[tuple[Callable[[Any], Any], Future]] = []
        self._inflight = 0  # admitted and not finished
        self._pauses = 0
        self._failed: EngineFailed | None = None
        self._ids = itertools.count()
        self._sleeps = sleeps
        self._asleep = False
        ready: Future = Future()
        self._thread = threading.Thread(target=self._serve, args=(build, ready), name=name, daemon=True)
        self._thread.start()
        self.llm = ready.result()

    # ---- what callers do ----------------------------------------------------------------------
    def submit(self, items: list[tuple[list[int], Any]], lora: Any = None) -> list[Future]:
        """Queue (prompt token ids, `SamplingParams`) requests, under adapter ``lora`` (a
        `LoRARequest`) if given, admitted together at the next step (after any pause); a future of
        each one's final `RequestOutput` (params with `output_kind=FINAL_ONLY`: the engine reports
        a request once, when it is done)."""
        requests = [_Request(list(prompt), params, Future(), lora) for prompt, params in items]
        with self._cond:
            self._raise_if_failed()
            self._pending.extend(requests)
            self._cond.notify_all()
        return [r.future for r in requests]

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(llm)`` on the engine's thread between two steps; its result (or its exception)."""
        future: Future = Future()
        with self._cond:
            self._raise_if_failed()
            self._jobs.append((fn, future))
            self._cond.notify_all()
        return future.result()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No request runs inside: waits for the admitted ones, holds back new ones (re-entrant)."""
        with self._cond:
            self._pauses += 1
            self._cond.wait_for(lambda: self._inflight == 0 or self._failed is not None)
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Fail what is queued, stop the thread (requests running are abandoned)."""
        with self._cond:
            if self._failed is None:
                self._failed = EngineFailed("the engine was closed")
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    # ---- the engine's thread ------------------------------------------------------------------
    def _serve(self, build: Callable[[], Any], ready: Future) -> None:
        try:
            llm = build()
        except BaseException as exc:  # noqa: BLE001 - the constructor re-raises it
            ready.set_exception(exc)
            return
        ready.set_result(llm)
        running: dict[str, Future] = {}
        try:
            while self._iteration(llm, running):
                pass
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets it
            self._fail(EngineFailed(f"the vLLM engine failed: {type(exc).__name__}: {exc}"), running)

    def _iteration(self, llm: Any, running: dict[str, Future]) -> bool:
        """Run the jobs, admit the pending requests (unless paused), take one step; False once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._failed is not None or self._jobs or self._inflight
                                or (self._pending and not self._pauses))
            if self._failed is not None:
                self._fail(self._failed, running)
                return False
            jobs, self._jobs = self._jobs, []
            admitted: list[_Request] = []
            if not self._pauses:
                admitted, self._pending = self._pending, []
                self._inflight += len(admitted)
        if self._asleep and (jobs or admitted):
            llm.wake_up()
            self._asleep = False
        settled: list[tuple[Future, Any, BaseException | None]] = []
        for fn, future in jobs:
            try:
                settled.append((future, fn(llm), None))
            except Exception as exc:  # noqa: BLE001 - the caller's
                settled.append((future, None, exc))
        finished = 0
        for request in admitted:
            request_id = f"meshrl-{next(self._ids)}"
            try:
                llm.llm_engine.add_request(request_id, {"prompt_token_ids": request.prompt}, request.params,
                                          lora_request=request.lora)
                running[request_id] = request.future
            except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails alone
                settled.append((request.future, None, exc))
                finished += 1
        try:
            if running:
                for output in llm.llm_engine.step():
                    if output.finished and output.request_id in running:
                        settled.append((running.pop(output.request_id), output, None))
                        finished += 1
        except BaseException:
            _settle(settled)
            raise
        with self._cond:
            self._inflight -= finished
            idle = not (self._inflight or self._pending or self._jobs)
            self._cond.notify_all()
        if idle and self._sleeps and not self._asleep:
            llm.sleep(level=1)
            self._asleep = True
        _settle(settled)  # after any sleep: a caller that sees its result sees the engine idle
        return True

    def _fail(self, error: EngineFailed, running: dict[str, Future]) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = error
            waiting = [r.future for r in self._pending] + [f for _, f in self._jobs] + list(running.values())
            self._pending, self._jobs = [], []
            self._inflight = 0
            self._cond.notify_all()
        running.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(error)


def _settle(settled: list[tuple[Future, Any, BaseException | None]]) -> None:
    for future, value, exc in settled:
        if exc is None:
            future.set_result(value)
        else:
            future.set_exception(exc)


def gather(futures: list[Future], combine: Callable[[list[Any]], Any]) -> Future:
    """A future of ``combine([f.result() for f in futures])`` once all are done (the first
    failure instead, if one fails)."""
    out: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            out.set_result(combine([f.result() for f in futures]))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            out.set_exception(exc)

    if not futures:
        out.set_result(combine([]))
    for future in futures:
        future.add_done_callback(done)
    return out
