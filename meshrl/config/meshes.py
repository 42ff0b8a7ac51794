"""Where each actor mesh runs: process counts, co-location, supervision timing."""

from __future__ import annotations

from pydantic import Field, model_validator

from meshrl.config.base import Section

MESH_NAMES = ("generator", "learner", "rewarder")


class MeshSpec(Section):
    """One actor mesh's placement."""

    procs: int = Field(1, ge=1)
    """Processes (one actor each) in this mesh."""

    colocate_with: str | None = None
    """Name of another mesh whose processes this mesh's actors share (None = own processes)."""


class MeshesConfig(Section):
    """Actor-mesh layout on the local host (multi-host launchers come later)."""

    generator: MeshSpec = MeshSpec()
    """Generator replicas (vLLM engines)."""

    learner: MeshSpec = MeshSpec()
    """Learner processes (one for now; data parallelism comes with multi-host launching)."""

    rewarder: MeshSpec = MeshSpec()
    """Rewarder processes (verifiers)."""

    chunks_per_replica: int = Field(4, ge=1)
    """A batch that a mesh's replicas share (generation, scoring) goes out in about this many chunks
    per replica, each to whichever replica is free; the last ones are hedged on idle replicas. More
    chunks balance better, fewer batch better; a mesh of one process gets the batch in one call."""

    supervision_poll_s: float = Field(0.5, gt=0)
    """How often Monarch polls child processes for failure (HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY)."""

    spawn_timeout_s: float = Field(300.0, gt=0)
    """Deadline for a mesh to spawn and finish its actors' setup (model load, engine start)."""

    @model_validator(mode="after")
    def _check_colocation(self) -> "MeshesConfig":
        for name in MESH_NAMES:
            spec: MeshSpec = getattr(self, name)
            target = spec.colocate_with
            if target is None:
                continue
            if target not in MESH_NAMES or target == name:
                raise ValueError(f"{name}.colocate_with = {target!r}: expected one of the other meshes {MESH_NAMES}")
            host: MeshSpec = getattr(self, target)
            if host.colocate_with is not None:
                raise ValueError(f"{name}.colocate_with = {target!r}: {target} is itself co-located")
            if host.procs != spec.procs:
                raise ValueError(f"{name}.procs = {spec.procs}: must equal {target}.procs = {host.procs} to co-locate")
        if self.learner.procs != 1:
            raise ValueError(f"learner.procs = {self.learner.procs}: only 1 learner process is supported so far")
        return self


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
