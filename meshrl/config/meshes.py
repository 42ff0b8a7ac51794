"""Where each actor mesh runs: process counts, co-location, GPUs, supervision timing."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from meshrl.config.base import Section

GENERATOR, LEARNER, REWARDER = "generator", "learner", "rewarder"
MESH_NAMES = (GENERATOR, LEARNER, REWARDER)
"""The meshes every run has (each with its `meshes.<name>` placement)."""
ENV, SDPO_TEACHER, TEACHER_REPLAY = "env", "sdpo_teacher", "teacher_replay"
REPLAY_REFERENCE = "replay_reference"
"""Meshes a run adds beside MESH_NAMES: the code task's env mesh (in the rewarder's place), the SDPO
teacher, the teacher replay pool and the replay pairs' reference actor."""


class MeshSpec(Section):
    """One actor mesh's placement."""

    procs: int = Field(1, ge=1)
    """Processes (one actor each) in this mesh."""

    colocate_with: str | None = None
    """Name of another mesh whose processes this mesh's actors share (None = own processes)."""

    gpus_per_proc: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """GPUs each process of this mesh sees (0 = CPU-only: on a host with GPUs its processes see
    none). `auto` lets the run choose from the host's GPUs (`meshrl plan` prints the choice and
    why): none on a CPU host; on a GPU host the learner gets one GPU per process and the generator
    one per replica on the GPUs left (as many replicas as there are such GPUs unless `procs` is
    set), or with one GPU shares the learner's processes and GPU (co-located); every other mesh
    stays on the CPU. With `devices` set, `auto` means `len(devices) / procs`. A co-located mesh
    uses the GPUs of the processes it shares and sets none itself."""

    devices: list[Annotated[int, Field(ge=0)]] | None = None
    """Host GPU indices for this mesh (`nvidia-smi` numbering, or positions in the controller's
    CUDA_VISIBLE_DEVICES when that is set): `procs * gpus_per_proc` of them, process r gets the
    r-th slice of `gpus_per_proc`. None = the lowest free indices, assigned in the order learner,
    generator, rewarder, then channel meshes."""

    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    """Share of each of its GPUs' memory this mesh's processes may allocate (PyTorch's per-process
    cap; a vLLM generator's `gpu_memory_utilization` becomes it). None = the GPUs are this mesh's
    alone. Two meshes may name the same GPU in `devices` (e.g. `[0]` on both, asynchronous training
    overlapping generation and learning on one GPU) when each sets one and they sum to at most 1."""

    @field_validator("gpus_per_proc", "devices")
    @classmethod
    def _own_gpus(cls, value, info: ValidationInfo):
        shared = info.data.get("colocate_with")
        if shared is not None and value and value != "auto":
            raise ValueError(f"no GPUs of its own: it shares {shared}'s processes and their GPUs")
        return value

    @field_validator("devices")
    @classmethod
    def _devices_fit(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None or "gpus_per_proc" not in info.data:
            return value
        procs, per_proc = info.data.get("procs", 1), info.data["gpus_per_proc"]
        if per_proc == "auto":
            per_proc = len(value) // procs or 1
        if len(value) != procs * per_proc:
            raise ValueError(f"procs * gpus_per_proc = {procs} * {per_proc} = {procs * per_proc} "
                             f"GPU indices, got {len(value)}")
        repeated = sorted({d for d in value if value.count(d) > 1})
        if repeated:
            raise ValueError(f"distinct GPU indices, {repeated[0]} appears more than once")
        return value


class MeshesConfig(Section):
    """Actor-mesh layout on the local host (multi-host launchers come later)."""

    generator: MeshSpec = MeshSpec()
    """Generator replicas (vLLM engines)."""

    learner: MeshSpec = MeshSpec()
    """Learner processes: more than one train the policy data-parallel (`learner.data_parallel`)."""

    rewarder: MeshSpec = MeshSpec()
    """Rewarder processes (verifiers); the code task's env mesh takes this placement."""

    chunks_per_replica: int = Field(4, ge=1)
    """A batch that a mesh's replicas share (generation, scoring) goes out in about this many chunks
    per replica, each to whichever replica is free; the last ones are hedged on idle replicas. More
    chunks balance better, fewer batch better; a mesh of one process gets the batch in one call."""

    supervision_poll_s: float = Field(0.5, gt=0)
    """How often Monarch polls child processes for failure (HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY,
    set from this over any value in the environment; a process that imported Monarch before keeps
    its own, logged)."""

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
            check_colocation(name, spec, target, getattr(self, target))
        return self


def check_colocation(key: str, spec: MeshSpec, target_key: str, target: MeshSpec) -> None:
    """Raise a ValueError naming ``key`` unless the mesh ``spec`` (at config key ``key``) can share
    the processes of ``target`` (at ``target_key``): a mesh with processes of its own, as many."""
    if target.colocate_with is not None:
        raise ValueError(f"{key}.colocate_with = {spec.colocate_with!r}: {target_key} is itself co-located "
                         f"(with {target.colocate_with})")
    if target.procs != spec.procs:
        raise ValueError(f"{key}.procs = {spec.procs}: must equal {target_key}.procs = {target.procs} to co-locate")


class ChannelMesh(MeshSpec):
    """Placement of a channel's actor mesh."""

    colocate_with: str | None = None
    """Share the processes of this main mesh (`generator`, `learner` or `rewarder`) instead of
    spawning new ones; it must have the same number of processes."""

    @model_validator(mode="after")
    def _check(self) -> "ChannelMesh":
        if self.colocate_with is not None and self.colocate_with not in MESH_NAMES:
            raise ValueError(f"colocate_with = {self.colocate_with!r}: expected one of {MESH_NAMES}")
        return self
