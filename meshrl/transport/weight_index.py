"""The weight store's index: the handles readers need to fetch a published version, and the
``WeightIndex`` actor that keeps them per store with their read leases (see ``weight_store.py``
for the publisher and puller around it). Holds only small handles; bytes stay with the owners."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, concurrent_endpoint, endpoint, get_or_spawn_controller
from monarch.rdma import RDMABuffer

from meshrl.transport.arena import ArenaLayout
from meshrl.transport.same_host import LocalRef
from meshrl.transport.shards import Piece, check_coverage

INDEX_NAME = "meshrl.weight_index"


class WeightSyncError(RuntimeError):
    """A weight publish or pull failed or timed out; the message is one line naming store,
    version and chunk."""


@dataclass(frozen=True)
class ChunkHandle:
    """One registered byte range ``[offset, offset + nbytes)`` of a published arena."""

    offset: int
    nbytes: int
    buffer: RDMABuffer


@dataclass(frozen=True)
class WeightHandle:
    """One publisher's part of a version (the whole version when ``world`` is 1): small and picklable."""

    store: str
    version: int
    layout: ArenaLayout
    """The whole version's layout (the same in every part)."""
    chunks: tuple[ChunkHandle, ...]
    owner_id: str
    publish_id: str
    """Unique per publish: a restarted owner may publish a version number again with other bytes."""
    host: str
    """The owner's ``same_host.host_identity()``: readers with the same identity may use ``local``."""
    local: LocalRef | None
    """How a reader on the owner's host reaches the arena (shared-memory segment or CUDA IPC handle);
    None when the owner shares nothing (transport rdma, or /dev/shm unusable)."""
    pieces: tuple[Piece, ...]
    """Where this part's bytes land in ``layout`` (``src`` in this part's arena)."""
    rank: int = 0
    world: int = 1
    """The version is complete, and visible to readers, once all ``world`` ranks published their part."""
    group: str = ""
    """The publishing ranks' group (one learner incarnation): parts of different groups never
    complete a version together."""


@dataclass(frozen=True)
class VersionHandle:
    """A complete version: every rank's part, by rank."""

    store: str
    version: int
    layout: ArenaLayout
    parts: tuple[WeightHandle, ...]

    @property
    def publish_id(self) -> str:
        """Identifies these bytes: the parts' publish ids."""
        return "+".join(p.publish_id for p in self.parts)


@dataclass
class _Lease:
    store: str
    version: int
    deadline: float


class WeightIndex(Actor):
    """Complete versions per store, the parts of versions still being published, the read leases
    and the latest version. Holds only small handles; bytes stay with the owners. A version some
    rank never finished publishing (it died) is never visible, and is forgotten once a newer
    version completes."""

    def __init__(self) -> None:
        self._handles: dict[str, dict[int, VersionHandle]] = {}
        self._pending: dict[str, dict[int, dict[int, WeightHandle]]] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._published = asyncio.Condition()

    def _latest(self, store: str) -> int | None:
        return max(self._handles.get(store) or (), default=None)

    def _reached(self, store: str, version: int) -> bool:
        latest = self._latest(store)
        return latest is not None and latest >= version

    @endpoint
    async def publish(self, handle: WeightHandle) -> bool:
        """Add one rank's part; True if that completed the version (it is now visible)."""
        store, version = handle.store, handle.version
        latest = self._latest(store)
        if latest is not None and version <= latest:
            raise WeightSyncError(f"publish of '{store}' v{version}: versions must increase (latest is v{latest})")
        parts = self._pending.setdefault(store, {}).setdefault(version, {})
        if any((p.group, p.world, p.layout) != (handle.group, handle.world, handle.layout) for p in parts.values()):
            parts.clear()  # parts of an earlier learner (restarted, or another world or model): never to complete
        if handle.rank in parts:
            raise WeightSyncError(f"publish of '{store}' v{version}: rank {handle.rank} published its part twice")
        parts[handle.rank] = handle
        if len(parts) < handle.world:
            return False
        ordered = [parts[r] for r in range(handle.world)]
        del self._pending[store][version]
        problem = check_coverage(handle.layout, [p.pieces for p in ordered])
        if problem is not None:
            raise WeightSyncError(f"publish of '{store}' v{version}: the {handle.world} parts do not assemble: {problem}")
        self._handles.setdefault(store, {})[version] = VersionHandle(store, version, handle.layout, tuple(ordered))
        for stale in [v for v in self._pending[store] if v < version]:  # torn: some rank never published
            del self._pending[store][stale]
        async with self._published:
            self._published.notify_all()
        return True

    @endpoint
    async def latest(self, store: str) -> int | None:
        return self._latest(store)

    @concurrent_endpoint
    async def acquire(
        self, store: str, min_version: int, have_id: str | None, wait_s: float, lease_s: float, exact: bool = False
    ) -> tuple[VersionHandle, int] | None:
        """Lease the newest complete version >= ``min_version`` (``exact``: version ``min_version``
        itself), waiting up to ``wait_s`` for one to be published. An exact version that is
        superseded but no longer held (reclaimed, or never published) is an error at once. Returns
        None (and takes no lease) if it is the publish ``have_id``."""
        if not self._reached(store, min_version):
            try:
                async with self._published:
                    await asyncio.wait_for(self._published.wait_for(lambda: self._reached(store, min_version)), wait_s)
            except asyncio.TimeoutError:
                latest = self._latest(store)
                have = f"v{latest}" if latest is not None else "no version"
                wanted = f"v{min_version} not published" if exact else f"no version >= v{min_version}"
                raise WeightSyncError(
                    f"weight pull of '{store}': {wanted} within {wait_s:g}s (index has {have})"
                ) from None
        versions = self._handles[store]
        handle = versions.get(min_version) if exact else versions[max(versions)]
        if handle is None:
            raise WeightSyncError(f"weight pull of '{store}' v{min_version}: not in the index (reclaimed, or never "
                                  f"published; it holds {', '.join(f'v{v}' for v in sorted(versions))})")
        if handle.publish_id == have_id:
            return None
        lease = next(self._lease_ids)
        self._leases[lease] = _Lease(store, handle.version, time.monotonic() + lease_s)
        return handle, lease

    @endpoint
    async def release(self, store: str, version: int, lease: int) -> bool:
        """End a lease. True if the version was never reclaimed meanwhile (the bytes read are intact)."""
        self._leases.pop(lease, None)
        return version in self._handles.get(store, {})

    def _owned(self, owner_id: str) -> set[int]:
        """Versions (complete or pending) in which ``owner_id`` has a part."""
        complete = {v for versions in self._handles.values() for v, h in versions.items()
                    if any(p.owner_id == owner_id for p in h.parts)}
        pending = {v for versions in self._pending.values() for v, parts in versions.items()
                   if any(p.owner_id == owner_id for p in parts.values())}
        return complete | pending

    @endpoint
    async def reclaim(self, owner_id: str, held: list[int], keep: int = 1) -> list[int]:
        """Forget the versions with a part of ``owner_id`` that are not among the ``keep`` newest of
        their store and have no live lease. Returns which of ``held`` (versions the owner still
        keeps buffers for) it may now drop."""
        now = time.monotonic()
        self._leases = {k: lease for k, lease in self._leases.items() if lease.deadline > now}
        leased = {(lease.store, lease.version) for lease in self._leases.values()}
        for store, versions in self._handles.items():
            kept = set(sorted(versions)[-keep:])
            for v in [v for v, h in versions.items() if any(p.owner_id == owner_id for p in h.parts)]:
                if v not in kept and (store, v) not in leased:
                    del versions[v]
        live = self._owned(owner_id)
        return [v for v in held if v not in live]

    @endpoint
    async def reset_owner(self, owner_id: str) -> list[int]:
        """Forget every version with a part of ``owner_id`` (it restarted or closed), and its parts
        of versions still being published; returns those versions."""
        gone = self._owned(owner_id)
        for versions in self._handles.values():
            for v in [v for v, h in versions.items() if any(p.owner_id == owner_id for p in h.parts)]:
                del versions[v]
        for versions in self._pending.values():
            for parts in versions.values():
                for rank in [r for r, p in parts.items() if p.owner_id == owner_id]:
                    del parts[rank]
        return sorted(gone)

    @endpoint
    async def describe(self, store: str) -> dict[str, Any]:
        """Versions, latest, live lease counts per version and the versions still being published
        (with the ranks that published their part) of ``store`` (for tests and debugging)."""
        versions = self._handles.get(store, {})
        now = time.monotonic()
        leases: dict[int, int] = {}
        for lease in self._leases.values():
            if lease.store == store and lease.deadline > now:
                leases[lease.version] = leases.get(lease.version, 0) + 1
        pending = {v: sorted(parts) for v, parts in self._pending.get(store, {}).items() if parts}
        return {"versions": sorted(versions), "latest": max(versions, default=None), "leases": leases,
                "pending": pending}


def weight_index():
    """Future of the ``WeightIndex`` singleton (spawned in the controller process on first use)."""
    return get_or_spawn_controller(INDEX_NAME, WeightIndex)
