"""Faults injected into a DiLoCo replica's own process, for tests and benchmarks that run replicas
through an executor: each entry point here wraps the replica entry point ``wrapped``
(``"pkg.module:function"``, called with the same arguments) and adds the fault."""

from __future__ import annotations

from meshrl.diloco.executors.base import ReplicaSpec
from meshrl.diloco.store import ObjectStore


def truncated_delta_replica(replica_id: int, replicas: int, wrapped: str, truncate_replica: int, truncate_round: int,
                            **kwargs) -> dict:
    """``wrapped``'s replica, where replica ``truncate_replica`` stores only the first half of its
    delta's bytes in round ``truncate_round`` (a broken upload) and then commits it as usual, with
    the checksum of the whole delta: the store really holds a corrupt object that the others must
    reject."""
    if replica_id == truncate_replica:
        suffix = f"/rounds/{truncate_round:06d}/delta-{replica_id:04d}"
        put = ObjectStore.put

        def broken_put(store: ObjectStore, key: str, data: bytes) -> None:
            put(store, key, data[: len(data) // 2] if key.endswith(suffix) else data)

        ObjectStore.put = broken_put  # this replica's process only
    return ReplicaSpec(wrapped, kwargs).run(replica_id, replicas)
