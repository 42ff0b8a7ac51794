"""The producer side of the loop: a thread that rolls out tasks continuously, in pieces ("units"),
ahead of the learner by at most `max_steps_off_policy` weight versions.

Admission control happens before generation: the producer starts on step s only while the latest
published version v satisfies ``s - 1 - v <= K``, so a sample is never more than K versions old
when it is trained (K = 0: generation and training take turns across steps). Between units the
producer brings every weight reader (generators, SDPO teacher) to the latest published version,
so weights change only between requests and generation never stalls for a publish.

A unit is `prompts_per_step / (num_substeps * num_minibatches)` tasks: rolled out, scored, shaped
(overlong), filtered (DAPO dynamic sampling) and handed to every loss term's `produce` (SDPO scores
its error sites with the hinted teacher there, at the same version that sampled them). Units go
into a :class:`StepFeed`, in order, where the learner takes them as soon as they exist. A step ends when `prompts_per_step` groups are in, or (dynamic
sampling) when `1 + max_extra_rounds` rounds of tasks were spent on it.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from meshrl.training.trajectories import Trajectory, groups_of, shape_overlong, uniform_groups

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.5


@dataclass
class Unit:
    """One piece of a step's data, as the producer made it."""

    step: int
    index: int
    groups: list[list[Trajectory]]
    """The groups to train on (informative ones only under dynamic sampling)."""
    sampled: list[Trajectory]
    """Everything sampled in this unit (the loss terms see all of it)."""
    metrics: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    """What the loss terms' `produce` and the rollout source attach, by name (SDPO's datums under
    `sdpo_jsd`, a learner of shards' teacher pairs under `pairs`)."""


class ProducerFailed(RuntimeError):
    """The producer thread stopped without an error of its own (it was stopped or died)."""


class StepFeed:
    """Units per step, in order, handed from the producer thread to the learner side."""

    def __init__(self):
        self.cond = threading.Condition()
        self.units: dict[int, list[Unit]] = {}
        self.ended: set[int] = set()
        self.error: BaseException | None = None

    def put(self, unit: Unit) -> None:
        with self.cond:
            self.units.setdefault(unit.step, []).append(unit)
            self.cond.notify_all()

    def end(self, step: int) -> None:
        with self.cond:
            self.ended.add(step)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def take(self, step: int, index: int, alive) -> Unit | None:
        """Unit ``index`` of ``step`` once it exists; None once the step has ended without it.
        Raises the producer's error, or ProducerFailed if ``alive()`` turns false meanwhile."""
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                units = self.units.get(step, [])
                if index < len(units):
                    return units[index]
                if step in self.ended:
                    return None
                if not alive():
                    raise ProducerFailed(f"the producer stopped before unit {index} of step {step}")
                self.cond.wait(WAIT_POLL_S)

    def release(self, step: int) -> None:
        """Forget a trained step's units."""
        with self.cond:
            self.units.pop(step, None)
            self.ended.discard(step)

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save({"units": self.units, "ended": sorted(self.ended)}, buffer)
        return {"units": base64.b64encode(buffer.getvalue()).decode("ascii")}

    def load_state_dict(self, state: dict) -> None:
        data = torch.load(io.BytesIO(base64.b64decode(state["units"])), weights_only=False)
        with self.cond:
            self.units, self.ended, self.error = data["units"], set(data["ended"]), None


@dataclass
class ProductionState:
    """Where production stands (checkpointed with the feed)."""

    step: int = 1
    """The step being produced."""
    cursor: int = 0
    """Data position of the next unit's first task."""
    round_cursor: int = 0
    """Data position of the current round's first task (rounds are prompts_per_step tasks)."""
    units: int = 0
    """Units produced for `step` so far."""
    groups: int = 0
    """Groups kept for `step` so far."""
    extra: dict = field(default_factory=dict)
    """The loss terms' counts for `step` so far (SDPO: its error sites, `sdpo_sites`)."""
    source: dict = field(default_factory=dict)
    """A rollout source's position, carried from step to step (a learner of shards: {producer:
    [shard index, groups of it used]}, meshrl.controller.shard_source)."""


class Producer:
    """Runs ``loop.produce_unit`` in a thread under admission control (see module docstring)."""

    def __init__(self, loop, last_step: int):
        self.loop = loop
        self.last_step = last_step
        self.feed = StepFeed()
        self.state = ProductionState()
        self.lock = threading.Lock()  # held while a unit is produced; paused() hands it out
        self.published = threading.Condition()
        self.version = 0  # the latest published version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- control from the learner side ------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="meshrl-producer", daemon=True)
            self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 900.0, wait: bool = True) -> None:
        """Stop after the unit in progress (its remote calls have their own deadlines). With
        ``wait=False`` (shutdown: the meshes are stopped next, which ends any call in flight) the
        thread is only told to stop."""
        self._stop.set()
        with self.published:
            self.published.notify_all()
        if self._thread is not None and wait:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the producer did not stop within {timeout_s:g}s")
            self._thread = None

    def publish(self, version: int) -> None:
        """A new version was published: admission may move on."""
        with self.published:
            self.version = version
            self.published.notify_all()

    def paused(self):
        """Context: no unit is being produced while it is held (for evaluation and snapshots)."""
        return self.lock

    # ---- the thread ------------------------------------------------------------------------
    def _admit(self, step: int) -> float:
        """Wait until producing ``step`` respects the staleness bound (a generation job's
        `publish` marks the steps it has written); returns the seconds waited."""
        started = time.perf_counter()
        k = self.loop.cfg.trainer.max_steps_off_policy
        with self.published:
            while step - 1 - self.version > k and not self._stop.is_set():
                self.published.wait(WAIT_POLL_S)
        return time.perf_counter() - started

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.state.step <= self.last_step:
                idle = self._admit(self.state.step)
                with self.lock:
                    if self._stop.is_set():
                        break
                    unit = self.loop.produce_unit(self.state, self.version)
                    unit.metrics["timing/generator_idle_s"] = idle
                    self.feed.put(unit)
                    if self.loop.step_complete(self.state):
                        self.feed.end(self.state.step)
                        self.state = ProductionState(self.state.step + 1, self.state.cursor, self.state.cursor,
                                                     source=self.state.source)
        except BaseException as e:  # noqa: BLE001 - handed to the learner side, which raises it
            log.error("producer failed: %s", e)
            self.feed.fail(e)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Call under ``paused()``: production state and every unit not yet trained."""
        return {"state": vars(self.state).copy(), "feed": self.feed.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Call with the thread stopped."""
        self.state = ProductionState(**state["state"])
        self.feed.load_state_dict(state["feed"])


def shape_and_filter(trajectories: list[Trajectory], cfg, metrics: dict) -> list[list[Trajectory]]:
    """Reward shaping (DAPO overlong) and, with `drop_uniform_groups`, dropping groups whose rewards
    are all equal (counted); returns the unit's groups to train on."""
    adv = cfg.trainer.advantage
    if adv.overlong_cache_tokens:
        metrics["count/overlong_penalised"] = shape_overlong(trajectories, cfg.generator.sampling.max_new_tokens,
                                                             adv.overlong_cache_tokens)
    by_group = groups_of(trajectories)
    dropped = uniform_groups(trajectories) if adv.drop_uniform_groups else set()
    if dropped:
        metrics["batch/dropped_uniform_groups"] = len(dropped)
    return [[trajectories[i] for i in members] for g, members in by_group.items() if g not in dropped]
