"""Running one training model's requests in `seq_id` order.

The SDK numbers the requests of a training client 1, 2, 3, ... and expects them to run in that
order, but they do not always arrive in it: the chunks of one forward_backward are sent
concurrently (the first chunk last, so the server sees the whole batch before it starts), and a
retried request may overtake a later one. `SeqOrder` holds early arrivals until every earlier
`seq_id` has started. A gap that stays open (a request that never arrives) is given up after a
timeout: the requests waiting behind it fail, and the queue continues after them.

Runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Waiting:
    start: Callable[[], None]
    fail: Callable[[str], None]


class SeqOrder:
    """A reorder buffer: `arrive` each request with its `seq_id`; `start` is called for each in
    `seq_id` order, `fail` (with a one-line reason) for one that can no longer run in order."""

    def __init__(self, name: str, gap_timeout_s: float, first_seq_id: int = 1):
        self._name = name
        self._gap_timeout_s = gap_timeout_s
        self._next = first_seq_id
        self._waiting: dict[int, _Waiting] = {}
        self._gap_timer: asyncio.TimerHandle | None = None

    def arrive(self, seq_id: int, start: Callable[[], None], fail: Callable[[str], None]) -> None:
        if seq_id < self._next:
            fail(f"seq_id {seq_id} of {self._name} arrived after seq_id {self._next - 1} had started")
            return
        if seq_id in self._waiting:
            fail(f"seq_id {seq_id} of {self._name} arrived twice")
            return
        self._waiting[seq_id] = _Waiting(start, fail)
        self._drain()

    def _drain(self) -> None:
        progressed = False
        while self._next in self._waiting:
            waiting = self._waiting.pop(self._next)
            self._next += 1
            progressed = True
            waiting.start()
        # the gap timer measures how long the current gap has been open
        if self._gap_timer is not None and (progressed or not self._waiting):
            self._gap_timer.cancel()
            self._gap_timer = None
        if self._waiting and self._gap_timer is None:
            self._gap_timer = asyncio.get_running_loop().call_later(self._gap_timeout_s, self._give_up_gap)

    def _give_up_gap(self) -> None:
        self._gap_timer = None
        missing = self._next
        last = max(self._waiting)
        for seq_id in sorted(self._waiting):
            self._waiting.pop(seq_id).fail(
                f"seq_id {seq_id} of {self._name} waited {self._gap_timeout_s:g} s "
                f"(serve.seq_gap_timeout_s) for seq_id {missing}, which never arrived")
        self._next = last + 1
