"""Flat ranks over actor meshes of any shape: a mesh spawned on one host has the dimension
`procs`, one spawned on a multi-host host mesh has `hosts` and `procs`. Rank r is the r-th actor in
row-major order of the mesh's dimensions (as `current_rank().rank` counts inside the actor)."""

from __future__ import annotations


def coordinates(extent, rank: int) -> dict[str, int]:
    """The coordinates of flat ``rank`` in ``extent`` (anything with `labels` and `sizes`)."""
    labels, sizes = list(extent.labels), list(extent.sizes)
    total = 1
    for size in sizes:
        total *= size
    if not 0 <= rank < total:
        raise IndexError(f"rank {rank} is outside a mesh of {total} actors ({dict(zip(labels, sizes))})")
    coords = {}
    for label, size in zip(reversed(labels), reversed(sizes)):
        coords[label] = rank % size
        rank //= size
    return coords


def actor_at(actors, rank: int):
    """The one-actor slice of the actor mesh ``actors`` at flat ``rank``."""
    return actors.slice(**coordinates(actors.extent, rank))


def reply_at(values, rank: int):
    """The reply of the actor at flat ``rank`` in the ValueMesh ``values`` of a mesh-wide call."""
    return values.item(**coordinates(values.extent, rank))
