"""Transport configuration: the weight store (``meshrl.channels.weight_store``) and the
delayed-result channel with its pool of teacher replay actors (``meshrl.channels.delayed``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from meshrl.config.base import Section


class WeightSyncConfig(Section):
    """Learner -> generator weight transfer: a versioned arena per published state dict, copied out
    of the learner's memory by generators on its host and read as concurrent chunked RDMA reads by
    the others."""

    transport: Literal["auto", "rdma", "shm"] = "auto"
    """How a pull moves the bytes. `auto`: a local copy when the publisher runs on this host (its CPU
    arena in shared memory under /dev/shm, its CUDA arena over CUDA IPC), RDMA otherwise or when the
    local arena cannot be opened. `rdma`: always RDMA (the publisher then shares no memory; for
    comparison). `shm`: the local copy only; a pull from a publisher elsewhere fails with a one-line
    error. On one 2-core CPU host a warm pull by local copy ran at 0.9-1.3x a memcpy of the same bytes,
    by RDMA (TCP fallback) at 0.06-0.13x (benchmarks/weight_transports.py)."""

    num_chunks: int = Field(32, ge=1, le=1024)
    """RDMA buffers each published arena is split into; RDMA readers fetch them concurrently. On one
    2-core CPU host (TCP fallback) the chunk count is what matters: a 269 MB pull ran at a median
    0.6-0.8 GB/s with 4-8 chunks and 1.0-1.6 GB/s with 32-64 (benchmarks/weight_sync.py)."""

    transfer_timeout_s: float = Field(60.0, gt=0)
    """Deadline for one pull's RDMA chunk reads (rounded up to whole seconds for the RDMA layer) and
    for a publisher waiting for a free arena; a dead owner surfaces as a WeightSyncError after this
    (at once for a local copy: a dead owner's shared memory is refused)."""

    rpc_timeout_s: float = Field(30.0, gt=0)
    """Deadline for each small control call to the weight index (publish, acquire, release)."""

    max_arenas: int = Field(3, ge=1)
    """Arenas a publisher may keep: the `keep_versions` newest versions plus versions still being
    read. With 2 they ping-pong; a publish that finds none free waits up to `transfer_timeout_s`,
    then raises."""

    keep_versions: int = Field(1, ge=1)
    """Newest published versions a publisher keeps readable (older ones are reclaimed once nobody
    reads them). 1 suits training, where readers want the latest; readers that pull exact older
    versions (samplers of the Tinker-style API, one version per sampler) need one per version in
    use. Each costs an arena of the published size (the adapter only under `learner.lora.sync:
    adapter`); must be below `max_arenas`, since a publish needs a free arena."""

    arena_device: Literal["cpu", "cuda"] = "cpu"
    """Where arenas live on both sides: `cpu`, or `cuda` (GPU memory registered for ibverbs
    GPUDirect RDMA; needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."""

    alignment: int = Field(64, ge=1)
    """Byte alignment of every tensor (and chunk boundary) in an arena; a power of two."""

    @model_validator(mode="after")
    def _arena_for_a_new_version(self) -> "WeightSyncConfig":
        if self.keep_versions >= self.max_arenas:
            raise ValueError(f"keep_versions {self.keep_versions} must be below max_arenas {self.max_arenas} "
                             "(a publish needs a free arena)")
        return self

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"a power of two, got {value}")
        return value


class DelayedChannelConfig(Section):
    """Channel 3's delayed-result channel and the pool of teacher replay actors that feeds it."""

    procs: int = Field(2, ge=1)
    """Teacher replay actors in the pool (one process each); the spend budget is split evenly."""

    max_traces_in_flight: int = Field(4, ge=1)
    """Traces one actor replays at once; further submissions wait in its queue (submit still
    returns at once)."""

    max_version_lag: int = Field(4, ge=0)
    """Results for a policy version older than ``current_version - max_version_lag`` are dropped
    (and counted) when drained."""

    rpc_timeout_s: float = Field(30.0, gt=0)
    """Deadline of each control call to the pool (subscribe, submit, ack, stats)."""

    result_timeout_s: float = Field(300.0, gt=0)
    """A submitted trace whose result has not arrived after this long is submitted again (a lost
    reply); after `max_attempts` it is abandoned and counted."""

    max_attempts: int = Field(2, ge=1)
    """Submissions of one trace before it is abandoned."""
