"""Channel 3: N external teachers replay the frozen trace; k-of-N agreement against the student
becomes a DPO pair that arrives later as a delayed result."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshrl.config.base import Section
from meshrl.config.meshes import LEARNER, ChannelMesh
from meshrl.config.teachers import TeacherEndpointConfig

CanonicaliserKind = Literal["math_answer", "code", "tool_call", "text"]


class ReplayPoolConfig(Section):
    """The pool of teacher replay actors and the delayed results it sends back (the replay term's
    inbox, ``meshrl.transport.delayed``)."""

    procs: int = Field(2, ge=1)
    """Teacher replay actors in the pool (one process each); the spend budget is split evenly."""

    max_traces_in_flight: int = Field(4, ge=1)
    """Traces one actor replays at once; further submissions wait in its queue (submit still
    returns at once)."""

    max_version_lag: int = Field(4, ge=0)
    """Results for a policy version older than ``current_version - max_version_lag`` are dropped
    (and counted) when drained, and so are their buffered pairs once they grow that old before
    their turn to be trained (`replay/pairs_stale`)."""

    rpc_timeout_s: float = Field(30.0, gt=0)
    """Deadline of each control call to the pool (subscribe, submit, ack, stats)."""

    result_timeout_s: float = Field(300.0, gt=0)
    """A submitted trace whose result has not arrived after this long is submitted again (a lost
    reply); after `max_attempts` it is abandoned and counted."""

    max_attempts: int = Field(2, ge=1)
    """Submissions of one trace before it is abandoned."""


class TeacherPanelConfig(Section):
    """Channel 3: replay frozen student traces to N teachers and turn k-of-N agreement into DPO pairs."""

    teachers: list[TeacherEndpointConfig] = Field(default_factory=list)
    """The N teacher endpoints; each student step is sent to all of them."""

    agreement_k: int = Field(default=2, ge=1)
    """A pair needs at least this many teachers agreeing on one action that differs from the student's."""

    budget_usd: float = Field(default=0.0, ge=0)
    """Spend limit for the whole run across all teachers, in USD; 0 means unlimited."""

    canonicaliser: CanonicaliserKind = "math_answer"
    """How actions are compared: final math answer, normalised code, tool-call JSON, or folded text."""

    max_steps_per_trace: int = Field(default=64, ge=1)
    """Only the first this-many student steps of a trace are replayed; the rest are counted as skipped."""

    trace_timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit for replaying one trace; unfinished steps are counted as timed out."""

    @model_validator(mode="after")
    def _check_teachers(self) -> TeacherPanelConfig:
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        if self.teachers and self.agreement_k > len(self.teachers):
            raise ValueError(f"agreement_k = {self.agreement_k} exceeds the {len(self.teachers)} teachers")
        return self


class ReplayReferenceConfig(Section):
    """Where a replay pair's reference log-probabilities (DPO's frozen initial policy) come from."""

    source: Literal["precomputed", "learner"] = "precomputed"
    """`precomputed`: once per pair, when the pair is formed, by a reference actor holding the
    initial weights in `model.dtype` (forward only, its own mesh: `mesh`); the pair carries both
    values into the buffer and the learner runs no reference forward and loads no frozen copy.
    `learner`: the learner computes them on every pass with its frozen initial policy (under full
    fine-tuning a float32 copy of the model on every learner rank; under LoRA the base weights)."""

    mesh: ChannelMesh = ChannelMesh()
    """Where the reference actor runs (`source: precomputed`): its own processes by default, or
    those of the `generator` or the `rewarder`; never the learner's."""

    call_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one scoring call on the reference mesh (a step's new pairs); past it the mesh
    is replaced and the call made again, like any supervised call."""

    beside_the_step: bool = False
    """Run the scoring calls beside the steps (one at a time, in a thread of the controller; a
    pair trains one step later at the earliest) instead of waiting for each in the drain before
    the step. For a reference mesh with a device of its own; where it shares the learner's CPU
    cores the two compete and the step is slower (on 2 cores the full three-channel step's
    learner time went from 15.6 to 27.3 s)."""

    @model_validator(mode="after")
    def _not_on_the_learner(self) -> "ReplayReferenceConfig":
        if self.mesh.colocate_with == LEARNER:
            raise ValueError("mesh.colocate_with = 'learner': the reference would sit in the learner's memory; "
                             "use source: learner instead")
        return self


class ReplayConfig(Section):
    """Channel 3: N external teachers replay the frozen trace; k-of-N agreement against the
    student becomes a DPO pair that arrives later as a delayed result."""

    beta: float = Field(0.0, ge=0)
    """Weight of the trace-replay DPO term in the total loss; 0 disables the channel at zero cost."""

    dpo_beta: float = Field(0.1, gt=0)
    """DPO temperature beta."""

    select: Literal["failed", "all"] = "failed"
    """Which trajectories are replayed: those the verifier failed, or all."""

    traces_per_step: int = Field(8, ge=1)
    """Most traces submitted for replay per step, shared among the step's units as they arrive
    (each an equal share of what is left, spread over its groups); the failures left out are
    counted (`replay/skipped_budget`)."""

    max_pairs_per_step: int = Field(16, ge=1)
    """Most DPO pairs trained on per step, oldest first; the rest wait in a buffer of at most
    ``max_pairs_per_step * (pool.max_version_lag + 1)`` pairs (the oldest beyond it are dropped,
    `replay/pairs_overflow`). The term is `beta` times the mean DPO loss over the pairs a step
    trains, however few."""

    max_outstanding: int = Field(64, ge=1)
    """Back-pressure: no new traces are submitted while this many are still being replayed."""

    teachers: TeacherPanelConfig = TeacherPanelConfig()
    """Teacher endpoints, agreement rule, budget, canonicaliser."""

    pool: ReplayPoolConfig = ReplayPoolConfig()
    """The replay actor pool and its delayed results."""

    reference: ReplayReferenceConfig = ReplayReferenceConfig()
    """The pairs' reference log-probabilities: computed once per pair off the learner, or by it."""
