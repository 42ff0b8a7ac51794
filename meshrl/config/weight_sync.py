"""Weight sync configuration: how published policy versions move from the learner to the
weight readers (``meshrl.transport.weight_store``)."""

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

    pull_bucket_mib: int = Field(512, ge=0)
    """MiB a reader's engine receives at a time: a pull fills a bucket of whole decoder layers (a
    layer larger than this gets a bucket of its size), loads it into the engine, then fills the
    next, so a reader holds its engine's weights plus one bucket, never a second full copy (a
    failed pull then leaves the engine's weights incomplete until the next pull succeeds). 0: the
    whole version is pulled into one arena, then loaded. Publishers cut their arenas into RDMA
    chunks no larger than this, and RDMA reads that cannot land in place are staged through at
    most this much memory. Under adapter-only LoRA sync (`learner.lora.sync: adapter`) each bucket's
    adapters are merged into the base weights of the layers they adapt, which are then loaded."""

    arena_device: Literal["cpu", "cuda"] = "cpu"
    """Where arenas live on both sides: `cpu`, or `cuda` (GPU memory registered for ibverbs
    GPUDirect RDMA; needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). A process that sees
    no GPU (a mesh placed on the CPU) keeps its own on the CPU and reads GPU arenas over RDMA."""

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
