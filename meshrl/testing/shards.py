"""A whole state dict cut into the dim-0 row shards FSDP2 would give each rank (``torch.chunk``
order: rank r holds rows [r * c, (r + 1) * c) of c = ceil(rows / world)), for weight-store tests
and benchmarks that publish sharded versions without a process group."""

from __future__ import annotations

import torch

from meshrl.transport.shards import Shard


def split_rows(state_dict: dict[str, torch.Tensor], rank: int, world: int,
               dtype: torch.dtype | None = None) -> dict[str, Shard]:
    """Rank ``rank``'s shards of ``state_dict``; names sharing one tensor stay tied."""
    out = {}
    for name, t in state_dict.items():
        rows = t.shape[0] if t.dim() else 1
        chunk = -(-rows // world)
        start = min(rank * chunk, rows)
        local = t[start: start + chunk] if t.dim() else (t if rank == 0 else t.reshape(1)[:0])
        out[name] = Shard(tuple(t.shape), dtype or t.dtype, start, local.shape[0] if t.dim() else int(rank == 0),
                          lambda local=local: local, key=id(t))
    return out
