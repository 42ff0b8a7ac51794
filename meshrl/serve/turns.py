"""Training calls of many tenants, one at a time, the tenants taking turns.

The learner runs one call at a time for every tenant (meshrl.api.tenant_learner), so whatever
order the calls reach it in is the order they run in. `Turns` decides that order: each tenant's
calls wait in a queue of their own, in the order they became ready (a model's requests become
ready in `seq_id` order: meshrl.serve.ordering), and one call is sent to the backend at a time:
the next call of the waiting tenant whose last turn is the oldest (one that never had a turn
first, then in arrival order). So a tenant's call waits for the call running and at most one call
of each other tenant, never for another's backlog.

A call's turn ends when its backend future completes, or after ``hold_limit_s`` (the request
timeout, when its request fails as timed out) if the backend never answers: a lost call does not
stop every tenant's training.

Runs on the server's event loop (a backend future may complete on any thread).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future

Start = Callable[[], Future | None]
"""Sends one call to the backend: its future, or None if it failed before reaching the backend."""


class Turns:
    """Per-tenant queues of training calls, dispatched one at a time in round-robin (see the module)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold_limit_s: float):
        self._loop = loop
        self._hold_limit_s = hold_limit_s
        self._queues: dict[Hashable, deque[Start]] = {}  # tenants with a waiting call, in arrival order
        self._last_turn: dict[Hashable, int] = {}  # each tenant's last turn, by number
        self._running: int | None = None  # the turn in progress, by number
        self._timer: asyncio.TimerHandle | None = None  # when the turn in progress ends at the latest
        self._numbers = itertools.count()

    def add(self, tenant: Hashable, start: Start) -> None:
        """Queue ``start`` (one backend call of ``tenant``), behind ``tenant``'s earlier calls."""
        self._queues.setdefault(tenant, deque()).append(start)
        self._next()

    def _next(self) -> None:
        while self._running is None and self._queues:
            tenant = min(self._queues, key=lambda t: self._last_turn.get(t, -1))
            queue = self._queues[tenant]
            start = queue.popleft()
            if not queue:
                del self._queues[tenant]
            number = self._last_turn[tenant] = next(self._numbers)
            future = start()
            if future is None:
                continue
            self._running = number
            self._timer = self._loop.call_later(self._hold_limit_s, self._finished, number)
            future.add_done_callback(lambda _, number=number: self._finished_soon(number))

    def _finished_soon(self, number: int) -> None:
        """End turn ``number`` on the event loop (called on the thread that completed its call)."""
        if not self._loop.is_closed():  # else the server has stopped: nobody waits for a turn
            self._loop.call_soon_threadsafe(self._finished, number)

    def _finished(self, number: int) -> None:
        if self._running == number:  # not a turn that its timer ended already
            self._timer.cancel()
            self._running = None
            self._next()
