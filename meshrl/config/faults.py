"""Fault handling and fault injection."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section


class FaultInjection(Section):
    """One fault to inject into a real run (used by tests and the fault demo config)."""

    mesh: str
    """Mesh to hit: `generator`, `rewarder`, `learner` (or any other mesh of the run)."""

    at_step: int = Field(ge=1)
    """Training step during which the fault happens."""

    action: Literal["kill", "delay", "raise", "drop"] = "kill"
    """`kill`: SIGKILL the actor's process; `delay`: the endpoint sleeps `seconds` (a hung actor
    when longer than the call deadline); `raise`: the endpoint raises once; `drop`: a teacher
    replay actor loses its next result (a teacher reply that never arrives)."""

    during: Literal["step_start", "generate", "score", "train", "sync", "sdpo"] = "generate"
    """For `kill`: the phase in flight when the process is killed (`step_start` = before any call;
    `sdpo` = the SDPO teacher's scoring call)."""

    endpoint: str = "generate"
    """For `delay` / `raise`: the endpoint that misbehaves on its next call."""

    rank: int = Field(0, ge=0)
    """Which actor of the mesh."""

    seconds: float = Field(0.5, ge=0)
    """For `kill`: delay after the phase starts; for `delay`: how long the endpoint sleeps."""


class FaultsConfig(Section):
    """How the controller survives failures of its meshes."""

    max_restarts: int = Field(3, ge=0)
    """Replacements allowed per mesh within `restart_window_s`; one more fails the run with an
    error naming the mesh and the cause."""

    restart_window_s: float = Field(600.0, gt=0)
    """Sliding window for the restart budget."""

    inject: list[FaultInjection] = []
    """Faults to inject (empty in normal runs)."""

    @model_validator(mode="after")
    def _unique_steps(self) -> "FaultsConfig":
        seen = set()
        for f in self.inject:
            key = (f.mesh, f.at_step, f.action)
            if key in seen:
                raise ValueError(f"inject: duplicate fault {key}")
            seen.add(key)
        return self
