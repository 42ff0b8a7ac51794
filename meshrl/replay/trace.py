"""Channel 3 trace replay: send every student step of a frozen trace to N teachers, canonicalise
their actions and turn k-of-N agreement against the student into DPO pairs.

Each teacher receives exactly the context messages the student saw at that step (state replay).
Steps are replayed concurrently, bounded by each client's concurrency limit; the whole trace is
bounded by ``TeacherPanelConfig.trace_timeout_s``. A teacher failure never escapes: it is counted by
kind, and the teacher simply does not vote on that step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshrl.replay.agreement import NoPairReason, PreferencePair, TeacherAnswer, decide_pair
from meshrl.replay.canonical import canonicalise
from meshrl.teachers.client import SpendMeter, TeacherClient, TeacherError
from meshrl.config.replay import TeacherPanelConfig


@dataclass(frozen=True)
class TraceStep:
    """One student step of a frozen trace."""

    context: list[dict[str, Any]]
    """The chat messages the student saw, exactly as sent to it."""
    action: str
    """The student's raw action text."""


@dataclass(frozen=True)
class Trace:
    """A finished rollout, frozen for replay."""

    episode_id: str
    steps: Sequence[TraceStep]


@dataclass(frozen=True)
class ReplayPair:
    """A DPO pair from one step of one trace."""

    episode_id: str
    step_index: int
    context: list[dict[str, Any]]
    """The prompt shared by chosen and rejected: the step's context."""
    preference: PreferencePair

    @property
    def chosen(self) -> str:
        return self.preference.chosen

    @property
    def rejected(self) -> str:
        return self.preference.rejected


@dataclass(frozen=True)
class StepOutcome:
    """What happened at one replayed step."""

    step_index: int
    student_canonical: str | None
    answers: tuple[TeacherAnswer, ...]
    failures: dict[str, str]
    """Teacher name -> error kind, for teachers whose call failed."""
    reason: NoPairReason | None
    """Why there is no pair, or None if the step produced one."""


@dataclass
class ReplayResult:
    """Pairs and counts from replaying one trace."""

    episode_id: str
    pairs: list[ReplayPair] = field(default_factory=list)
    steps: list[StepOutcome] = field(default_factory=list)
    """Completed steps, in step order."""
    steps_skipped: int = 0
    """Steps beyond ``max_steps_per_trace``."""
    steps_timed_out: int = 0
    """Steps unfinished when ``trace_timeout_s`` ran out."""
    teacher_calls: int = 0
    """Teacher calls that finished, successfully or not."""
    teacher_failures: Counter[str] = field(default_factory=Counter)
    """Failed teacher calls by error kind."""
    unusable_answers: int = 0
    """Successful replies in which the canonicaliser found no action."""
    no_pair_reasons: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def metrics(self, prefix: str = "replay") -> dict[str, float]:
        """Flat counters for the metrics logger."""
        out: dict[str, float] = {
            f"{prefix}/pairs": len(self.pairs),
            f"{prefix}/steps": len(self.steps),
            f"{prefix}/steps_skipped": self.steps_skipped,
            f"{prefix}/steps_timed_out": self.steps_timed_out,
            f"{prefix}/teacher_calls": self.teacher_calls,
            f"{prefix}/unusable_answers": self.unusable_answers,
            f"{prefix}/prompt_tokens": self.prompt_tokens,
            f"{prefix}/completion_tokens": self.completion_tokens,
            f"{prefix}/cost_usd": self.cost_usd,
        }
        out.update({f"{prefix}/failures/{kind}": n for kind, n in self.teacher_failures.items()})
        out.update({f"{prefix}/no_pair/{reason}": n for reason, n in self.no_pair_reasons.items()})
        return out


def teacher_clients(cfg: TeacherPanelConfig, meter: SpendMeter | None = None) -> list[TeacherClient]:
    """One client per configured teacher, all charging one spend meter (by default a new one
    with the run budget ``cfg.budget_usd``)."""
    shared = meter if meter is not None else SpendMeter(budget_usd=cfg.budget_usd)
    return [TeacherClient(teacher, shared) for teacher in cfg.teachers]


async def replay_trace(trace: Trace, clients: Sequence[TeacherClient], cfg: TeacherPanelConfig) -> ReplayResult:
    """Replay ``trace`` to every client and return its pairs and counts; never raises on teacher
    failures or timeouts."""
    result = ReplayResult(episode_id=trace.episode_id)
    steps = list(trace.steps[: cfg.max_steps_per_trace])
    result.steps_skipped = len(trace.steps) - len(steps)
    if not steps:
        return result
    tasks = [asyncio.create_task(_replay_step(i, step, clients, cfg, result)) for i, step in enumerate(steps)]
    try:
        done, pending = await asyncio.wait(tasks, timeout=cfg.trace_timeout_s)
    finally:  # on timeout, and also if the caller cancels us
        unfinished = [task for task in tasks if not task.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
    result.steps_timed_out = len(pending)
    for task in done:
        task.result()  # a bug (not a teacher failure) surfaces here
    result.steps.sort(key=lambda s: s.step_index)
    result.pairs.sort(key=lambda p: p.step_index)
    return result


async def _replay_step(
    index: int, step: TraceStep, clients: Sequence[TeacherClient], cfg: TeacherPanelConfig, result: ReplayResult
) -> None:
    asked = await asyncio.gather(*(_ask(client, step.context, cfg, result) for client in clients))
    answers = tuple(answer for answer, _ in asked)
    failures = {answer.teacher: kind for answer, kind in asked if kind is not None}
    student_canonical = canonicalise(cfg.canonicaliser, step.action)
    decision = decide_pair(step.action, student_canonical, answers, cfg.agreement_k)
    if decision.pair is not None:
        result.pairs.append(ReplayPair(result.episode_id, index, step.context, decision.pair))
    else:
        result.no_pair_reasons[decision.reason] += 1
    result.steps.append(StepOutcome(index, student_canonical, answers, failures, decision.reason))


async def _ask(
    client: TeacherClient, context: list[dict[str, Any]], cfg: TeacherPanelConfig, result: ReplayResult
) -> tuple[TeacherAnswer, str | None]:
    try:
        reply = await client.chat(context)
    except TeacherError as e:
        result.teacher_calls += 1
        result.teacher_failures[e.kind] += 1
        return TeacherAnswer(client.name, None, None), e.kind
    result.teacher_calls += 1
    result.prompt_tokens += reply.prompt_tokens
    result.completion_tokens += reply.completion_tokens
    result.cost_usd += reply.cost_usd
    canonical = canonicalise(cfg.canonicaliser, reply.text)
    if canonical is None:
        result.unusable_answers += 1
    return TeacherAnswer(client.name, reply.text, canonical), None
