"""Channels 2 and 3: SDPO hint self-distillation and N-teacher trace replay."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.channels.config import DelayedChannelConfig
from meshrl.config.base import Section
from meshrl.config.meshes import MESH_NAMES
from meshrl.teachers.config import HintGeneratorConfig, ReplayConfig

DEFAULT_HINTS: dict[str, str] = {
    "math.wrong_answer": "Hint: {extracted} is not right. The correct answer is {answer}.",
    "math.wrong_format": "Hint: finish with the final result as a plain number. The answer is {answer}.",
    "wrong_answer": "Hint: that answer is not right. The correct answer is {answer}.",
    "wrong_format": "Hint: the answer must be given plainly. The correct answer is {answer}.",
}


class ChannelMesh(Section):
    """Placement of a channel's actor mesh."""

    procs: int = Field(1, ge=1)
    """Processes (one actor each)."""

    colocate_with: str | None = None
    """Share the processes of this main mesh (`generator`, `learner` or `rewarder`) instead of
    spawning new ones; it must have the same number of processes."""

    @model_validator(mode="after")
    def _check(self) -> "ChannelMesh":
        if self.colocate_with is not None and self.colocate_with not in MESH_NAMES:
            raise ValueError(f"colocate_with = {self.colocate_with!r}: expected one of {MESH_NAMES}")
        return self


class SDPOConfig(Section):
    """Channel 2: the policy, re-run without grad on its context plus a hint at the error turn,
    is distilled back into the student on the error-site tokens with a generalized JSD."""

    alpha: float = Field(0.0, ge=0)
    """Weight of the SDPO JSD term in the total loss; 0 disables the channel at zero cost."""

    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    """Generalized JSD interpolation: 0 = KL(teacher||student), 1 = KL(student||teacher)."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature applied to both student and teacher logits."""

    top_k: int = Field(32, ge=0)
    """Teacher tokens kept per position (both distributions renormalised on them); 0 = full vocabulary."""

    max_sites_per_step: int = Field(16, ge=1)
    """Most error-site trajectories distilled per step."""

    is_weight_cap: float = Field(0.0, ge=0)
    """SDPO's per-token importance weight min(p/q, cap) on the JSD (0 = off; the paper uses 2)."""

    hints: dict[str, str] = DEFAULT_HINTS
    """Hint templates by hint_template_key (environment hints take precedence); fields such as
    {answer} and {extracted} come from the verifier's info and the problem."""

    hint_generator: HintGeneratorConfig = HintGeneratorConfig()
    """Optional LLM hint generator (same OpenAI-compatible client as the teachers)."""

    mesh: ChannelMesh = ChannelMesh()
    """Where the SDPOTeacherActor runs."""

    call_timeout_s: float = Field(300.0, gt=0)
    """Deadline for one teacher scoring call."""


class ReplayChannelConfig(Section):
    """Channel 3: N external teachers replay the frozen trace; k-of-N agreement against the
    student becomes a DPO pair that arrives later on the delayed channel."""

    beta: float = Field(0.0, ge=0)
    """Weight of the trace-replay DPO term in the total loss; 0 disables the channel at zero cost."""

    dpo_beta: float = Field(0.1, gt=0)
    """DPO temperature beta."""

    select: Literal["failed", "all"] = "failed"
    """Which trajectories are replayed: those the verifier failed, or all."""

    traces_per_step: int = Field(8, ge=1)
    """Most traces submitted for replay per step."""

    max_pairs_per_step: int = Field(16, ge=1)
    """Most DPO pairs trained on per step (the rest wait in the buffer)."""

    max_outstanding: int = Field(64, ge=1)
    """Back-pressure: no new traces are submitted while this many are still being replayed."""

    teachers: ReplayConfig = ReplayConfig()
    """Teacher endpoints, agreement rule, budget, canonicaliser."""

    channel: DelayedChannelConfig = DelayedChannelConfig()
    """The replay actor pool and the delayed-result channel."""

    @model_validator(mode="after")
    def _need_teachers(self) -> "ReplayChannelConfig":
        if self.beta > 0 and len(self.teachers.teachers) < self.teachers.agreement_k:
            raise ValueError(f"beta = {self.beta} needs at least teachers.agreement_k = "
                             f"{self.teachers.agreement_k} teachers, got {len(self.teachers.teachers)}")
        return self
