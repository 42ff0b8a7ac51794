"""Dynamic dispatch of one call's work over a mesh's replicas, with hedging.

A batch of items is cut into chunks, about `meshes.chunks_per_replica` per replica, that go out one
per free replica: a replica gets the next chunk as soon as it returns one, so a fast replica serves
more of the batch and a slow one less. When no chunk is left to hand out and a replica is free while
another still works, the oldest unfinished chunk is issued again to the free one (hedging): the
first reply wins, the other copy is a late duplicate and its reply is ignored.

A replica is a sync actor that serves one message at a time, so a late duplicate keeps it busy after
the call has returned. The dispatcher remembers such work ("leftovers", each with its call's
deadline counted from when it was issued) and gives the replica nothing new before it has finished.
A message sent to a busy replica (a weight pull) waits behind its earlier work: Monarch delivers one
sender's messages in order, so the replica loads the new weights before it serves anything else;
its reply is checked when it arrives. A slow replica thus holds neither the call nor the weight sync
after it. A leftover past its deadline means a hung replica: the next call raises `CallTimeout` and
the supervisor replaces the mesh, as for any call. Leftovers of a replaced mesh are forgotten.

Monarch's Future has no done() or callback, and ``get(timeout=...)`` never consumes it (a later get
still returns the result): "the first of these futures to finish" is a sweep of zero-timeout gets,
then a short blocking get on one of them. This works from any thread (the producer's or the main one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.meshes.supervisor import WATCH_INTERVAL_S, CallTimeout, ProcessDied
from meshrl.meshes.group import first_line
from meshrl.meshes.ranks import actor_at

log = logging.getLogger(__name__)
POLL_S = 0.01  # longest wait before the futures not waited on are swept again (a sweep costs ~1 ms each)


def split_evenly(items: list, parts: int) -> list[list]:
    """``parts`` contiguous slices whose sizes differ by at most one (empty slices dropped)."""
    n = len(items)
    bounds = [n * i // parts for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts) if bounds[i] < bounds[i + 1]]


def chunk_bounds(n: int, replicas: int, chunks_per_replica: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of ``n`` items: about ``chunks_per_replica`` per replica, sizes
    within one of each other, a single chunk for a single replica. The cut depends on these three
    numbers only, never on which replica serves what."""
    parts = 1 if replicas == 1 else replicas * chunks_per_replica
    return [(part[0], part[-1] + 1) for part in split_evenly(list(range(n)), parts)]


def finished(future) -> bool:
    """Whether ``future`` has resolved, with a value or an error, without waiting."""
    try:
        future.get(timeout=0)
    except TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - resolved with an error: the owner reads it with get()
        return True
    return True


def first_finished(futures: list, timeout_s: float) -> int | None:
    """Index of a future of ``futures`` (not empty) that has resolved, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if len(futures) == 1:  # nothing else to sweep: block (each wake-up preempts the engines' spinning
        try:               # OpenMP threads on a small host; polling slowed 1-replica generation ~40%)
            futures[0].get(timeout=timeout_s)
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - resolved with an error
            pass
        return 0
    while True:
        for i, future in enumerate(futures):
            if finished(future):
                return i
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:  # wakes at once if this one resolves; the others are swept again after POLL_S
            futures[0].get(timeout=min(POLL_S, left))
        except TimeoutError:
            continue
        except Exception:  # noqa: BLE001 - resolved with an error
            pass
        return 0


@dataclass
class _Work:
    """One message in flight to one replica."""

    replica: int
    future: Any
    deadline: float
    """When it was issued plus its call's deadline (a leftover past it is a hung replica)."""
    timeout_s: float
    what: str
    chunk: int = -1
    """The chunk it serves (-1: not a chunk of the current call)."""
    check: Callable[[Any], None] | None = None
    """For a leftover whose reply matters (a weight pull): called with the reply; its errors raise.
    None: a late duplicate, whose reply and errors are ignored."""


class Dispatcher:
    """Spreads calls over one mesh's replicas and remembers what each replica still works on."""

    def __init__(self):
        self._actors = None  # the actor mesh the leftovers were sent to
        self._leftovers: list[_Work] = []
        self._lock = threading.Lock()  # the producer thread and the learner side share the meshes

    def _settle(self, actors, now: float, watch: Callable[[], str | None] | None = None) -> set[int]:
        """Drop the leftovers that have finished (checking those whose reply matters); raise
        CallTimeout for one past its deadline, and ProcessDied when a replica is still busy while
        ``watch()`` reports a dead process (its leftover would never finish). Returns the replicas
        still busy."""
        with self._lock:
            if actors is not self._actors:  # a replaced mesh: its old work is gone with it
                self._actors, self._leftovers = actors, []
            busy = []
            for work in self._leftovers:
                if finished(work.future):
                    _read(work)
                elif now > work.deadline:
                    raise CallTimeout(f"{work.what} timed out after {work.timeout_s:g}s")
                else:
                    busy.append(work)
            self._leftovers = busy
        reason = watch() if busy and watch else None
        if reason:
            raise ProcessDied(f"{busy[0].what}: {reason}")
        return {work.replica for work in busy}

    def _leave(self, works: list[_Work]) -> None:
        with self._lock:
            self._leftovers += works

    def run(self, actors, replicas: int, n: int, chunks_per_replica: int, issue: Callable[[Any, int, int], Any],
            timeout_s: float, what: str, watch: Callable[[], str | None] | None = None) -> list:
        """Serve items ``[0, n)`` in chunks; ``issue(replica_actor, start, stop)`` returns a chunk's
        future. Returns each chunk's reply (the first to arrive), in order. One deadline for the whole
        call (CallTimeout); ProcessDied when ``watch()`` reports a dead process; the error of a failed
        chunk is raised as it came."""
        bounds = chunk_bounds(n, replicas, chunks_per_replica)
        todo = deque(range(len(bounds)))
        replies: dict[int, Any] = {}
        running: list[_Work] = []
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(bounds):
            busy = self._settle(actors, time.monotonic(), watch) | {w.replica for w in running}
            for r in (r for r in range(replicas) if r not in busy):
                chunk = todo.popleft() if todo else _oldest_least_copied(running, replies)
                if chunk is None:
                    break
                future = issue(actor_at(actors, r), *bounds[chunk])
                running.append(_Work(r, future, time.monotonic() + timeout_s, timeout_s, what, chunk))
            with self._lock:
                waiting = running + self._leftovers
            i = first_finished([w.future for w in waiting], min(WATCH_INTERVAL_S, max(deadline - time.monotonic(), 0)))
            if i is None:
                if time.monotonic() >= deadline:
                    raise CallTimeout(f"{what} timed out after {timeout_s:g}s")
                reason = watch() if watch else None
                if reason:
                    raise ProcessDied(f"{what}: {reason}")
                continue
            if i >= len(running):
                continue  # a leftover finished: settled at the top of the loop
            work = running.pop(i)
            if work.chunk in replies:
                _read(work)  # a duplicate that lost
                continue
            replies[work.chunk] = work.future.get(timeout=0)
        self._leave(running)  # late duplicates: their replicas stay busy until they finish
        return [replies[c] for c in range(len(bounds))]

    def send_all(self, actors, replicas: int, send: Callable[[Any], Any], check: Callable[[Any], None],
                 timeout_s: float, what: str, watch: Callable[[], str | None] | None = None) -> list:
        """``send(replica_actor)`` to every replica. Returns the futures of the free replicas (the
        caller waits for them); a busy replica serves the message after its earlier work, and its
        reply is passed to ``check`` when it arrives (errors raise at a later call). ProcessDied
        when a replica is busy and ``watch()`` reports a dead process."""
        busy = self._settle(actors, time.monotonic(), watch)
        deadline = time.monotonic() + timeout_s
        now, later = [], []
        for r in range(replicas):
            future = send(actor_at(actors, r))
            if r in busy:
                later.append(_Work(r, future, deadline, timeout_s, what, check=check))
            else:
                now.append(future)
        self._leave(later)
        return now


def _oldest_least_copied(running: list[_Work], replies: dict) -> int | None:
    """The unfinished chunk to hedge: the one running on the fewest replicas, the oldest among them."""
    copies = Counter(w.chunk for w in running if w.chunk not in replies)  # in issue order
    return min(copies, key=copies.__getitem__) if copies else None


def _read(work: _Work) -> None:
    """Take a finished leftover's reply: check it, or ignore a late duplicate's reply or error."""
    try:
        reply = work.future.get(timeout=0)
    except Exception as e:  # noqa: BLE001 - a late duplicate's failure changes nothing
        if work.check is not None:
            raise
        log.warning("%s: a late duplicate on replica %d failed: %s", work.what, work.replica, first_line(e))
        return
    if work.check is not None:
        work.check(reply)
