"""DiLoCo across replicas (``meshrl.diloco``): replicas that may run as separate jobs, with no
network between them, exchange pseudo-gradients through an object store every `inner_steps`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section


class DiLoCoConfig(Section):
    """Decoupled low-communication training: each replica trains `inner_steps` steps with its own
    optimizer, then the replicas average their pseudo-gradients (round-start weights minus current
    weights) through the object store at `store_url` and all apply the same outer Nesterov step."""

    enabled: bool = False
    """Take part in DiLoCo rounds (the learner syncs through the store every `inner_steps` steps)."""

    store_url: str = ""
    """fsspec URL of the shared store root: `file:///shared/dir`, `s3://bucket/prefix`,
    `gs://bucket/prefix`, `hf://...` (the backend package must be installed: s3fs, gcsfs, ...)."""

    storage_options: dict[str, object] = {}
    """Keyword arguments for the fsspec filesystem (e.g. `{endpoint_url: http://host:9000, key: ...,
    secret: ...}` for an S3-compatible endpoint)."""

    run_id: str = Field("diloco", pattern=r"^[A-Za-z0-9][\w.-]*$")
    """Prefix under `store_url` for this training run's rounds and outer states; replicas of one run
    share it."""

    replicas: int = Field(2, ge=1)
    """Number of replicas in the run."""

    replica_id: int = Field(0, ge=0)
    """This replica's id, 0 .. replicas-1 (deltas are averaged in replica-id order)."""

    inner_steps: int = Field(10, ge=1)
    """H: inner optimizer steps between two synchronisations."""

    quorum: int | None = Field(None, ge=1)
    """Fewest replicas whose deltas make a round; None = all `replicas`. With fewer than all, a round
    goes ahead `straggler_wait_s` after the quorum arrived; a delta committed after that is ignored
    and its replica adopts the round's outer state."""

    outer_lr: float = Field(0.7, gt=0)
    """Outer optimizer learning rate (DiLoCo paper: 0.7)."""

    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """Outer optimizer momentum (DiLoCo paper: 0.9)."""

    nesterov: bool = True
    """Nesterov momentum for the outer step (DiLoCo paper: true); false = heavy-ball momentum."""

    delta_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the uploaded pseudo-gradients (bf16 halves the bytes; averaging is in fp32)."""

    compression: Literal["none", "zlib"] = "none"
    """Compression of uploaded deltas and outer states."""

    round_timeout_s: float = Field(600.0, gt=0)
    """Deadline for a round to reach its quorum; past it the round fails with a one-line error."""

    straggler_wait_s: float = Field(5.0, ge=0)
    """Once the quorum has committed, how long to wait for the remaining replicas before sealing."""

    poll_interval_s: float = Field(0.2, gt=0)
    """Pause between two listings of the store while waiting."""

    op_timeout_s: float = Field(120.0, gt=0)
    """Deadline for each store operation (one upload, download or listing)."""

    keep_rounds: int = Field(3, ge=1)
    """Rounds (deltas, seals and outer states) the leader keeps in the store; older ones are deleted."""

    rollout_shards: bool = False
    """Also write every step's trained rollouts (token ids, logprobs, rewards, policy version) as
    checksummed shards with manifests under `<store_url>/<run_id>/shards/` (meshrl.diloco.shards),
    one shard per step, produced as `replica<replica_id>`; works without `enabled` too (needs
    `store_url`). `meshrl shards URL` lists and verifies them."""

    shard_compression: Literal["none", "zlib"] = "zlib"
    """Compression of the rollout shards' JSONL records."""

    role: Literal["train", "generate", "learn"] = "train"
    """What this job does with rollouts. `train`: sample and train on them (a whole RL replica).
    `generate`: a generation job: sample with the run's weights and write every step's groups as
    rollout shards (`rollout_shards` implied, produced as `gen<replica_id>`), never train; with
    `enabled` it follows the run's newest outer state every `inner_steps` steps (it reads rounds,
    never uploads, and is not counted in `replicas`); with `replay.beta` > 0 it replays its samples
    to the teachers and writes the pairs that arrive into its shards. `learn`: train on the shards
    of the run's generation jobs instead of sampling (its generators only evaluate), its DPO term
    (`replay.beta` > 0) on their teacher pairs; with `enabled` a replica of the run like `train`.
    SDPO (`sdpo.alpha` > 0) needs role `train`. See meshrl.controller.shard_source."""

    shard_wait_s: float = Field(600.0, gt=0)
    """`role: learn`: how long a step waits for new rollout shards before failing with a one-line
    error."""

    max_rounds_behind: int = Field(1, ge=0)
    """Staleness of split jobs, in DiLoCo rounds. `role: learn`: train only on groups sampled with
    weights at most this many rounds older than the learner's (older ones are dropped, logged and
    counted in `stale_dropped`). `role: generate` with `enabled`: at the end of its round r, wait
    (up to `round_timeout_s`) until the run has reached round r - max_rounds_behind, so it does not
    sample further ahead of the learners."""

    @model_validator(mode="after")
    def _check(self) -> "DiLoCoConfig":
        if self.role != "generate" and self.replica_id >= self.replicas:
            raise ValueError(f"replica_id {self.replica_id} must be below replicas ({self.replicas})")
        if self.quorum is not None and self.quorum > self.replicas:
            raise ValueError(f"quorum {self.quorum} exceeds replicas ({self.replicas})")
        if (self.enabled or self.rollout_shards or self.role != "train") and not self.store_url:
            raise ValueError("store_url is required when enabled, rollout_shards or role generate/learn (e.g. "
                             "file:///tmp/diloco or s3://bucket/prefix)")
        if self.role == "learn" and self.rollout_shards:
            raise ValueError("rollout_shards with role learn would write back the shards it trains on: set one")
        return self
