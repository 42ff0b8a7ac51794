"""Teacher replay actor (channel 3): replays frozen student traces to N external teachers in the
background and sends each trace's DPO pairs back as a delayed result (meshrl.transport.delayed).

A pool of these actors (one per process) runs beside training. ``submit`` only schedules the
replay and returns, so the controller never waits on a teacher; the result arrives later as one
``DelayedMessage`` per submitted trace, whose payload is a ``TraceReplayOutcome``. A trace whose
replay fails entirely still yields a message (no pairs, ``error`` set), so the controller's
outstanding work always drains.

The actor is all-async (the HTTP client is asyncio): every endpoint is ``async def``. API keys are
read by the teacher clients from the environment at request time and never logged or returned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from monarch.actor import Actor, Port, current_rank, current_size, endpoint

from meshrl.actors.base import process_identity
from meshrl.transport.delayed import DelayedOutbox
from meshrl.teachers.client import SpendMeter
from meshrl.config.replay import ReplayPoolConfig, TeacherPanelConfig
from meshrl.replay.trace import ReplayPair, Trace, replay_trace, teacher_clients

log = logging.getLogger(__name__)

WHOLE_EPISODE = -1
"""``DelayedMessage.step`` of a trace result: it covers every step of the episode."""


@dataclass(frozen=True)
class TraceReplayOutcome:
    """Payload of one trace's message."""

    pairs: list[ReplayPair]
    metrics: dict[str, float] = field(default_factory=dict)
    """``ReplayResult.metrics()``: steps, teacher calls, failures by kind, no-pair reasons, spend."""
    error: str | None = None
    """Why the replay failed entirely (then ``pairs`` is empty), or None."""
    seconds: float = 0.0
    """Wall time of the replay, excluding time queued behind ``max_traces_in_flight``."""


def producer_name(name: str, rank: int) -> str:
    """The producer name an actor of pool ``name`` at ``rank`` stamps on its messages."""
    return f"{name}/{rank}"


class TeacherReplayActor(Actor):
    """One member of the teacher replay pool: endpoints ``subscribe``, ``submit``, ``ack``,
    ``stats`` and ``info``."""

    def __init__(self, replay_cfg: TeacherPanelConfig, pool_cfg: ReplayPoolConfig, name: str = "teacher_replay"):
        self.rank = current_rank().rank
        self.producer = producer_name(name, self.rank)
        self.replay_cfg = replay_cfg
        pool_size = math.prod(current_size().values())
        self.meter = SpendMeter(budget_usd=replay_cfg.budget_usd / pool_size)
        self.clients = teacher_clients(replay_cfg, self.meter)
        self.outbox = DelayedOutbox(self.producer)
        self.slots = asyncio.Semaphore(pool_cfg.max_traces_in_flight)
        self.tasks: dict[str, asyncio.Task] = {}
        self.running = 0
        self.counts: Counter[str] = Counter()
        self.teacher_failures: Counter[str] = Counter()
        self.drop_results = 0  # results to drop (fault injection)

    @endpoint
    async def info(self) -> dict:
        return {**process_identity(), "producer": self.producer, "teachers": [c.name for c in self.clients]}

    @endpoint
    async def subscribe(self, port: Port) -> int:
        """Send results to ``port`` from now on; re-sends every unacknowledged result. Returns how
        many were re-sent."""
        return self.outbox.subscribe(port)

    @endpoint
    async def submit(self, work_key: str, trace: Trace, policy_version: int) -> bool:
        """Schedule the replay of ``trace`` and return at once. The result is sent with key
        ``work_key``. Returns False (and does nothing) if that key is already being replayed or
        waiting for its ack."""
        if work_key in self.tasks or self.outbox.holds(work_key):
            self.counts["duplicate_submissions"] += 1
            return False
        task = asyncio.create_task(self._replay(work_key, trace, policy_version))
        self.tasks[work_key] = task
        task.add_done_callback(lambda _, key=work_key: self.tasks.pop(key, None))
        self.counts["submitted"] += 1
        return True

    @endpoint
    async def inject_fault(self, endpoint_name: str, action: str, seconds: float = 0.0) -> None:
        """Fault injection: ``action == "drop"`` loses the next result instead of sending it."""
        if action != "drop":
            raise ValueError(f"teacher replay actors support only the 'drop' fault, got {action!r}")
        self.drop_results += 1

    @endpoint
    async def carry_spend(self, cost_usd: float) -> float:
        """Charge this actor's meter with its share of the run's earlier spend (called on a
        replacement); returns the meter's total, which the budget is checked against."""
        self.meter.carry_over(cost_usd)
        return self.meter.total.cost_usd

    @endpoint
    async def ack(self, keys: list[str]) -> int:
        """Drop acknowledged results; returns how many were held."""
        return self.outbox.ack(keys)

    @endpoint
    async def stats(self) -> dict:
        spend = self.meter.total
        return {
            "producer": self.producer,
            **{name: self.counts[name] for name in ("submitted", "replayed", "replay_errors", "pairs",
                                                  "duplicate_submissions", "peak_running", "dropped_by_fault")},
            "running": self.running,
            "queued": len(self.tasks) - self.running,
            **self.outbox.stats(),
            "teacher_failures": dict(self.teacher_failures),
            "teacher_outcomes": {c.name: dict(c.counts) for c in self.clients},
            "spend": {"calls": spend.calls, "prompt_tokens": spend.prompt_tokens,
                      "completion_tokens": spend.completion_tokens, "cost_usd": spend.cost_usd,
                      "budget_usd": self.meter.budget_usd, "rejected_calls": self.meter.rejected_calls,
                      "carried_usd": self.meter.carried_usd},
        }

    async def _replay(self, work_key: str, trace: Trace, policy_version: int) -> None:
        async with self.slots:
            self.running += 1
            self.counts["peak_running"] = max(self.counts["peak_running"], self.running)
            started = time.monotonic()
            try:
                result = await replay_trace(trace, self.clients, self.replay_cfg)
            except Exception as e:  # not a teacher failure (those are counted inside): a bad trace or a bug
                self.counts["replay_errors"] += 1
                log.warning("%s: replay of %s failed: %s: %s", self.producer, work_key, type(e).__name__, e)
                outcome = TraceReplayOutcome([], error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - started)
            else:
                self.counts["replayed"] += 1
                self.counts["pairs"] += len(result.pairs)
                self.teacher_failures.update(result.teacher_failures)
                outcome = TraceReplayOutcome(result.pairs, result.metrics(), seconds=time.monotonic() - started)
            finally:
                self.running -= 1
        if self.drop_results > 0:  # fault injection: the reply is lost on the way
            self.drop_results -= 1
            self.counts["dropped_by_fault"] += 1
            return
        self.outbox.send(
            work_key, outcome, episode_id=trace.episode_id, step=WHOLE_EPISODE, policy_version=policy_version
        )

    async def _handle_undeliverable_message(self, message: object) -> bool:
        # Our consumer is gone: the result stays in the outbox until a new one subscribes.
        self.outbox.count_undeliverable()
        return True

    async def __cleanup__(self, exc: object) -> None:
        # Cancel replays first: a replay broken by its closed client would otherwise be reported as
        # failed, and the controller would take that for its result instead of re-submitting it.
        unfinished = list(self.tasks.values())
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        for client in self.clients:
            await client.aclose()
