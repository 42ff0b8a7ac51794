"""The replies of the SDK's `RestClient` listings, built from the server's records: sessions,
training runs (`TrainingRun`) and checkpoints (`SavedCheckpoint`), in the JSON shapes of the SDK's
types (`ListSessionsResponse`, `TrainingRun`, `TrainingRunsResponse`, `CheckpointsListResponse`).
Newest first; ``limit`` / ``offset`` page through a list and the reply's cursor gives the total."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import pydantic

from meshrl.api.errors import UserError
from meshrl.serve.tenants import CHECKPOINT_PREFIX
from meshrl.serve.training import SavedCheckpoint, TrainingRun

T = TypeVar("T")


class WeightsInfoRequest(pydantic.BaseModel, extra="forbid"):
    """The body of `RestClient.get_weights_info_by_tinker_path` (the SDK declares no type for it)."""

    tinker_path: str


class CheckpointTtlRequest(pydantic.BaseModel, extra="forbid"):
    """The body of `RestClient.set_checkpoint_ttl_from_tinker_path`."""

    ttl_seconds: int | None = pydantic.Field(None, gt=0)


def page_bounds(query: dict[str, str], default_limit: int) -> tuple[int, int]:
    """``limit`` and ``offset`` of a listing's query; UserError unless both are integers >= 0."""
    try:
        limit, offset = int(query.get("limit", default_limit)), int(query.get("offset", 0))
    except ValueError:
        raise UserError(f"limit and offset must be integers, got {query.get('limit')!r}, "
                        f"{query.get('offset')!r}") from None
    if limit < 0 or offset < 0:
        raise UserError(f"limit = {limit}, offset = {offset}: both must be >= 0")
    return limit, offset


def page(items: Sequence[T], limit: int, offset: int) -> tuple[list[T], dict[str, int]]:
    """One page of ``items`` and its cursor."""
    return list(items[offset:offset + limit]), {"offset": offset, "limit": limit, "total_count": len(items)}


def checkpoint_path(training_run_id: str, checkpoint_id: str) -> str:
    """The `tinker://` path of a run's checkpoint (``weights/<name>`` or ``sampler_weights/<name>``)."""
    return f"{CHECKPOINT_PREFIX}{training_run_id}/{checkpoint_id}"


def newest_first(checkpoints: Iterable[SavedCheckpoint]) -> list[SavedCheckpoint]:
    return sorted(checkpoints, key=lambda c: c.time, reverse=True)


def training_run(run: TrainingRun, owner: str, checkpoints: Iterable[SavedCheckpoint]) -> dict[str, Any]:
    """A run as the SDK's `TrainingRun`, with its newest training and sampler checkpoints."""
    latest = {}
    for saved in newest_first(checkpoints):
        latest.setdefault(saved.checkpoint_id.split("/", 1)[0], saved.sdk())
    return {"training_run_id": run.model_id, "base_model": run.spec.base_model, "model_owner": owner,
            "is_lora": True, "lora_rank": run.spec.rank, "last_request_time": run.last_request.isoformat(),
            "last_checkpoint": latest.get("weights"), "last_sampler_checkpoint": latest.get("sampler_weights"),
            "user_metadata": run.user_metadata}


def weights_info(saved: SavedCheckpoint) -> dict[str, Any]:
    """A checkpoint's adapter as the SDK's `WeightsInfoResponse`."""
    spec = saved.spec
    optimizer = {"type": spec.optimizer, **({"version": 1} if spec.optimizer == "dimuon" else {})}
    return {"base_model": spec.base_model, "is_lora": True, "lora_rank": spec.rank,
            "train_unembed": spec.train_unembed, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn,
            "optimizer_config": optimizer}
