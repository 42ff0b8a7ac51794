"""Delayed results: producers (e.g. teacher replay actors) send results whenever they are
ready; the consumer (the controller or learner side) drains them without ever waiting.

Built on a Monarch port (``Channel.open()``); Monarch has no pub/sub service. The consumer owns a
``DelayedInbox``: its port is handed to every producer, and a daemon thread moves arriving messages
into a thread-safe queue so that ``drain`` is a non-blocking poll. Each producer owns a
``DelayedOutbox`` that keeps every message until the consumer acknowledges it.

Delivery guarantee:

* **At-least-once delivery** of every message whose producer survives: the outbox keeps a message
  until ``ack``; ``subscribe(port)`` re-sends everything unacknowledged, in ``seq`` order.
* **Exactly-once acceptance by key** at the consumer: ``drain`` returns a key at most once and
  counts later copies as duplicates. Accepted keys are remembered until their policy version falls
  behind the stale horizon; after that any copy is dropped as stale, so the guarantee holds with
  bounded memory (the horizon never moves back). This holds relative to the state the inbox
  holds: an inbox restored from an older ``state_dict`` accepts again the keys accepted after it
  was saved (wanted when the training on them was lost along with the consumer).
* A message is **acknowledged** once the consumer has drained it (accepted, stale or duplicate) and
  the producer, told through ``ack(keys)``, has dropped it from its outbox. Acks are best effort:
  a lost ack only causes a re-send that the consumer drops as a duplicate (and acks again).
* **Consumer replaced** (closed inbox, new inbox): carry the dedupe state over with
  ``new.load_state_dict(old.state_dict())`` (or from a checkpoint), then re-subscribe every
  producer with ``new.port``. Everything not yet acknowledged is re-sent; messages sent while no
  consumer listened are undeliverable (the producer should count them: ``count_undeliverable``)
  and stay in the outbox.
* **Producer replaced**: its outbox dies with it, so unacknowledged work must be submitted again.
  The consumer records submitted work with ``expect(key, producer)``; ``outstanding(producer)``
  lists the keys submitted but not yet drained; re-submit those to the new producer. A result of
  the old producer that was still in flight then arrives twice and is accepted once.

Ordering: Monarch ports deliver in order per sender, so one producer's messages arrive in ``seq``
order except for re-sends. Nothing is ordered across producers.

Controller loop::

    inbox = DelayedInbox()
    pool.subscribe.call(inbox.port).get(timeout=...)
    inbox.expect(key, producer); producer_actor.submit.call_one(key, work, version).get(timeout=...)
    for msg in inbox.drain(current_version, cfg.max_version_lag): use(msg.payload)
    for producer, keys in inbox.acks().items(): actor_of[producer].ack.call_one(keys).get(timeout=...)
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from monarch.actor import Channel, Port

log = logging.getLogger(__name__)

STATE_FORMAT = 1
COUNTER_NAMES = ("received", "accepted", "stale_dropped", "duplicates")




@dataclass(frozen=True)
class DelayedMessage:
    """One delayed result."""

    key: str
    """Dedupe key: the consumer accepts each key once. Usually the submitted work's key."""
    episode_id: str
    step: int
    """Episode step the result is about; -1 when it covers the whole episode."""
    policy_version: int
    """Policy version that produced the episode; drives the stale check."""
    producer: str
    """Name of the sending producer; acks are routed back by it."""
    seq: int
    """Per-producer sequence number, starting at 0 for each producer incarnation."""
    payload: Any


@dataclass(frozen=True)
class _Stop:
    token: str


class DelayedInbox:
    """Consumer end: a port for producers and a non-blocking ``drain``. Use from one thread."""

    def __init__(self, close_timeout_s: float = 10.0):
        self._close_timeout_s = close_timeout_s
        self._port, self._receiver = Channel.open()
        self._stop = _Stop(uuid.uuid4().hex)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._accepted: dict[str, int] = {}  # key -> policy version, pruned at the stale horizon
        self._expected: dict[str, str] = {}  # key -> producer it was submitted to
        self._pending_acks: dict[str, list[str]] = defaultdict(list)
        self._horizon: int | None = None
        self._counts: Counter[str] = Counter()
        self._by_producer: dict[str, Counter[str]] = defaultdict(Counter)
        self.receive_errors = 0
        self._thread = threading.Thread(target=self._receive_loop, name="delayed-inbox", daemon=True)
        self._thread.start()

    @property
    def port(self) -> Port:
        """Hand this to producers (``subscribe``)."""
        return self._port

    def _receive_loop(self) -> None:
        # No timeout on recv: a timed-out recv leaves a pending receive that swallows the next
        # message. close() ends the loop by sending the stop token to our own port.
        while True:
            try:
                item = self._receiver.recv().get()
            except Exception as e:  # a producer sent an exception, or the receive failed
                item = e
            if isinstance(item, _Stop) and item == self._stop:
                return
            self._queue.put(item)  # drain() counts anything that is not a DelayedMessage

    def close(self) -> None:
        """Stop receiving. Undrained messages are discarded; they were never acknowledged, so their
        producers re-send them when subscribed to a new inbox. Raises TimeoutError if the receive
        thread does not stop in time."""
        if self._receiver is None:
            return
        self._port.send(self._stop)
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"delayed inbox: receive thread did not stop within {self._close_timeout_s:g}s")
        self._receiver = None  # unbinds the port: later sends come back to producers as undeliverable

    def __enter__(self) -> DelayedInbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expect(self, key: str, producer: str = "") -> None:
        """Record that work ``key`` was submitted to ``producer`` (again, if re-submitted)."""
        self._expected[key] = producer

    def forget(self, key: str) -> None:
        """Stop expecting ``key`` (its work was abandoned); a late result is still accepted once."""
        self._expected.pop(key, None)

    def outstanding(self, producer: str | None = None) -> list[str]:
        """Keys submitted (to ``producer``, or to any) and not drained yet, in submission order."""
        return [k for k, p in self._expected.items() if producer is None or p == producer]

    def drain(self, current_version: int, max_version_lag: int) -> list[DelayedMessage]:
        """Return the newly accepted messages, in arrival order, without waiting. Copies of an
        accepted key are dropped as duplicates; messages older than the stale horizon
        ``current_version - max_version_lag`` (never moving back) are dropped as stale."""
        horizon = current_version - max_version_lag
        if self._horizon is None or horizon > self._horizon:
            self._horizon = horizon
            self._accepted = {k: v for k, v in self._accepted.items() if v >= horizon}
        accepted: list[DelayedMessage] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return accepted
            if not isinstance(item, DelayedMessage):
                self.receive_errors += 1
                log.warning("delayed inbox: ignored a %s (not a DelayedMessage)", type(item).__name__)
                continue
            outcome = self._classify(item)
            self._count(item.producer, "received")
            self._count(item.producer, outcome)
            self._pending_acks[item.producer].append(item.key)
            self._expected.pop(item.key, None)
            if outcome == "accepted":
                self._accepted[item.key] = item.policy_version
                accepted.append(item)

    def _classify(self, message: DelayedMessage) -> str:
        if message.key in self._accepted:
            return "duplicates"
        if message.policy_version < self._horizon:  # set by drain() before classifying
            return "stale_dropped"
        return "accepted"

    def _count(self, producer: str, name: str) -> None:
        self._counts[name] += 1
        self._by_producer[producer][name] += 1

    def acks(self) -> dict[str, list[str]]:
        """Keys drained since the last call, grouped by producer: send each group to its
        producer's ``ack``."""
        pending, self._pending_acks = dict(self._pending_acks), defaultdict(list)
        return pending

    def stats(self) -> dict[str, Any]:
        """Counters (received, accepted, stale_dropped, duplicates; overall and by producer)."""
        return {
            **{name: self._counts[name] for name in COUNTER_NAMES},
            "by_producer": {p: {n: c[n] for n in COUNTER_NAMES} for p, c in self._by_producer.items()},
            "outstanding": len(self._expected),
            "remembered_keys": len(self._accepted),
            "receive_errors": self.receive_errors,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able dedupe, expectation and counter state, for checkpoints and for a replacement
        inbox. Acks not yet fetched with ``acks()`` are not saved: their producers re-send those
        messages, which are then dropped as duplicates and acknowledged again."""
        return {
            "format": STATE_FORMAT,
            "horizon": self._horizon,
            "accepted": dict(self._accepted),
            "expected": dict(self._expected),
            "counts": dict(self._counts),
            "by_producer": {p: dict(c) for p, c in self._by_producer.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"delayed inbox state format {state.get('format')!r}, expected {STATE_FORMAT}")
        self._horizon = state["horizon"]
        self._accepted = dict(state["accepted"])
        self._expected = dict(state["expected"])
        self._counts = Counter(state["counts"])
        self._by_producer = defaultdict(Counter, {p: Counter(c) for p, c in state["by_producer"].items()})


class DelayedOutbox:
    """Producer end: keeps every sent message until acknowledged. Use from one actor's loop (or
    thread); not thread-safe."""

    def __init__(self, producer: str):
        self.producer = producer
        self._port: Port | None = None
        self._unacked: dict[str, DelayedMessage] = {}  # insertion order = seq order
        self._next_seq = 0
        self.counts: Counter[str] = Counter()

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def holds(self, key: str) -> bool:
        """True if a message with ``key`` is waiting for its ack."""
        return key in self._unacked

    def subscribe(self, port: Port) -> int:
        """Send to ``port`` from now on and re-send every unacknowledged message to it, in seq
        order. Returns how many were re-sent."""
        self._port = port
        for message in self._unacked.values():
            port.send(message)
        self.counts["resent"] += len(self._unacked)
        return len(self._unacked)

    def send(self, key: str, payload: Any, *, episode_id: str, step: int, policy_version: int) -> DelayedMessage | None:
        """Stamp and send a message (kept until acked; only kept while nobody is subscribed).
        Returns None, sending nothing, if a message with ``key`` is already waiting for its ack."""
        if key in self._unacked:
            return None
        message = DelayedMessage(key, episode_id, step, policy_version, self.producer, self._next_seq, payload)
        self._next_seq += 1
        self._unacked[key] = message
        if self._port is not None:
            self._port.send(message)
            self.counts["sent"] += 1
        return message

    def ack(self, keys: list[str]) -> int:
        """Drop acknowledged messages; unknown keys are ignored. Returns how many were dropped."""
        dropped = sum(self._unacked.pop(key, None) is not None for key in keys)
        self.counts["acked"] += dropped
        return dropped

    def count_undeliverable(self) -> None:
        """Record a send that Monarch returned as undeliverable (the consumer is gone); the message
        stays unacknowledged and is re-sent on the next ``subscribe``."""
        self.counts["undeliverable"] += 1

    def stats(self) -> dict[str, int]:
        return {"sent": self.counts["sent"], "resent": self.counts["resent"], "acked": self.counts["acked"],
                "undeliverable": self.counts["undeliverable"], "unacked": self.unacked}
