"""Versioned weight store: the learner publishes state dicts (whole, or each data-parallel rank its
own shards), readers pull them by a path chosen by locality: a copy out of the publisher's shared
memory (CPU) or CUDA IPC handle (GPU) when they run on its host (``meshrl.transport.same_host``),
``monarch.rdma.RDMABuffer`` reads otherwise (ibverbs on GPU hosts, the TCP fallback on CPU).

The TorchStore design (index + data owners + RDMA handles), rebuilt for Monarch 0.7:

* ``WeightIndex`` (in ``weight_index.py``) - a light all-async actor, one named singleton in the
  controller process (``get_or_spawn_controller("meshrl.weight_index", WeightIndex)``). Per store it keeps the
  complete versions (every rank's part: layout, pieces, chunk RDMA buffers), the parts of versions
  still being published, the read leases and the latest version.
* ``WeightPublisher`` - a plain object inside each data owner (a learner rank). Each version's part
  (the rank's shards, see ``shards.py``; the whole state dict for a single rank) is packed into a
  flat arena from a small pool (CPU arenas in named shared memory, CUDA arenas exported for CUDA
  IPC), registered as RDMA chunks and announced to the index with the owner's host identity. The
  version becomes visible once every rank announced its part. Versions that are not among the
  ``keep_versions`` newest and unleased are reclaimed: their buffers are dropped (stale handles then
  fail instead of reading other bytes) and the arena is reused.
* ``WeightPuller`` - a plain object inside each reader. A pull leases the newest (or an exact)
  complete version and assembles it from every part (local copies from parts on the reader's host
  under ``transport`` auto or shm, RDMA chunk reads from the others): either into one arena whose
  zero-copy views it returns (``pull``), or bucket by bucket, whole decoder layers at a time, into a
  caller's loader (``pull_into``: the reader never holds a second full copy; with ``slices`` it
  takes only a tensor-parallel rank's slice of each tensor; with ``elsewhere`` a bucket whose parts
  are all on this host is handed, as a small ``HostFill``, to another process, a tensor-parallel
  worker, which copies it out of the publishers' arenas itself). It releases the lease at the end.

Both objects offer sync methods (for sync actor endpoints and plain scripts) and ``a``-prefixed
coroutines (for async actors; ``.get()`` would block their event loop). Both variants run the same
step generator (``_publish_steps``, ``_pull_steps``): it yields what it waits for, and a driver
(``_drive`` / ``_adrive``, in ``meshrl.transport.steps``) waits on it with ``Future.get`` or ``await``.

Every remote call and transfer has a deadline; failures surface as a one-line ``WeightSyncError``
naming the store, version and chunk. Objects are not thread-safe: use each from one actor.

Usage (sync actors shown; async actors ``await`` ``apublish`` / ``apull`` instead)::

    class Learner(Actor):
        def __init__(self, cfg):
            self.weights = WeightPublisher("policy", cfg.weight_sync)

        @endpoint
        def train_step(self, batch) -> int:
            ...  # optimiser step
            self.version += 1
            self.weights.publish(self.model.state_dict(), self.version)  # copies: training may go on
            return self.version

    class Generator(Actor):
        def __init__(self, cfg):
            self.weights = WeightPuller("policy", cfg.weight_sync)

        @endpoint
        def sync_weights(self, min_version: int) -> int:
            result = self.weights.pull_into(self.engine.load_weights, min_version)  # bucket by bucket
            return result.version  # no transfer if already at the latest version
"""

from __future__ import annotations

import functools
import logging
import math
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from monarch.actor import ActorError
from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.transport.arena import allocate_arena, chunk_ranges, usable_device, views
from meshrl.transport.same_host import (
    HostFill,
    OwnerGone,
    SameHostReader,
    SameHostUnavailable,
    SharedArena,
    host_identity,
    local_transport,
)
from meshrl.transport.shards import (
    Bucket,
    Move,
    Shard,
    TensorSlice,
    apply_move,
    moves,
    pack_part,
    plan_buckets,
    plan_part,
    rdma_plan,
    shards_of,
    whole_bucket,
)
from meshrl.transport.steps import Steps, _adrive, _Await, _AwaitAll, _drive, _one_line, _Run, _Sleep
from meshrl.transport.weight_index import ChunkHandle, VersionHandle, WeightHandle, WeightSyncError, weight_index

_POLL_S = 0.05  # publisher re-checks for a free arena this often while all are leased
_DRIVER_SLACK_S = 5.0  # extra wait beyond the RDMA layer's own timeout before giving up on a read
_STAGING_BYTES = 64 << 20  # staging for RDMA reads that cannot land in place, when pulls are not bucketed

logger = logging.getLogger(__name__)

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's ``(name, tensor)`` pairs (views valid only during the call)."""
Elsewhere = Callable[[HostFill], bool]
"""Takes one bucket as a :class:`HostFill` to be filled and loaded by another process on this host
(a tensor-parallel engine's worker); False declines it (it is then filled here and goes to the
loader)."""
Slicer = Callable[[dict[str, tuple[int, ...]]], Mapping[str, TensorSlice]]
"""Given every tensor's whole shape, the slice a reader takes of each (tensors left out come whole),
e.g. a tensor-parallel engine rank's (``meshrl.engines.vllm_sharding.tensor_slices``)."""


@dataclass(frozen=True)
class PublishStats:
    version: int
    nbytes: int
    """Bytes this publisher packed (its part of the version)."""
    total_bytes: int
    """Bytes of the whole version (every rank's part)."""
    seconds: float
    pack_seconds: float
    register_seconds: float
    reclaimed: tuple[int, ...]
    """Versions whose buffers this publish dropped (superseded and no longer read)."""
    arenas: int
    """Arenas in the publisher's pool after this publish."""
    complete: bool = True
    """Whether this part completed the version (False while other ranks' parts are missing)."""


@dataclass(frozen=True)
class PullStats:
    seconds: float
    """Whole pull: lease, transfer, loading (bucketed pulls) and release."""
    transfer_seconds: float
    nbytes: int
    """Bytes received (the arena, or the buckets' tensors; 0 when the reader already had the latest version)."""
    transport: str
    """How they moved: "shm", "cuda_ipc", "rdma", several joined by "+" (parts on several hosts),
    "worker_shm" / "worker_cuda_ipc" (buckets the loader's own processes copied out of the
    publishers' arenas: ``pull_into(elsewhere=...)``), or "none" when nothing moved."""
    read_bytes: int = 0
    """Bytes copied out of the publishers' arenas or read over RDMA (whole chunks, where a bucket
    needs only part of one)."""
    load_seconds: float = 0.0
    """Time in the loader (bucketed pulls)."""
    buckets: int = 0
    """Buckets handed to the loader (0: pulled into one arena)."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PullResult:
    version: int
    tensors: dict[str, torch.Tensor]
    """Zero-copy views into the puller's arena: valid, and the same objects, until the next pull
    that transfers (which overwrites them in place). Empty after a bucketed pull."""
    stats: PullStats


def silence_tcp_fallback_warning() -> None:
    """Monarch warns once per process that RDMA falls back to TCP; expected on CPU hosts."""
    warnings.simplefilter("ignore", RDMATcpFallbackWarning)


# ---------------------------------------------------------------------------------- index calls


def _call(what: str, future: Any, timeout_s: float) -> Steps:
    """One index call: its result, or a WeightSyncError (the index's own one-liner when it raised one)."""
    try:
        return (yield _Await(future, timeout_s))
    except ActorError as e:
        if isinstance(e.exception, WeightSyncError):
            raise e.exception from None
        raise WeightSyncError(f"{what}: weight index call failed: {_one_line(e.exception)}") from e
    except TimeoutError:
        raise WeightSyncError(f"{what}: weight index did not answer within {timeout_s:g}s") from None


def _chunk_count(total_bytes: int, config: WeightSyncConfig) -> int:
    """``num_chunks``, or more so that no chunk exceeds a reader's bucket."""
    bucket = config.pull_bucket_mib << 20
    return max(config.num_chunks, -(-total_bytes // bucket) if bucket else 1)


# ------------------------------------------------------------------------------------- publisher


@dataclass
class _Arena:
    shared: SharedArena
    version: int | None = None
    buffers: tuple[RDMABuffer, ...] = ()


class WeightPublisher:
    """Publishes versions of one store from a process that owns weights (a learner rank).

    ``publish(state_dict, version)`` (a whole state dict, one rank) or ``publish_shards(shards,
    version)`` (this rank's ``Shard``s; every one of ``world`` ranks publishes its own) from sync
    code, ``await apublish(...)`` / ``apublish_shards`` from async actors. ``owner_id`` names this
    data owner in the index (default: the store name for rank 0, ``store#rank<r>`` for the others);
    a new publisher with the same id forgets its predecessor's versions on first use, as after a
    learner restart. ``group`` is shared by the ranks of one learner (default: this publisher's
    own): a restarted learner's parts never complete a version with its predecessor's.
    """

    def __init__(self, store: str, config: WeightSyncConfig | None = None, owner_id: str | None = None,
                 rank: int = 0, world: int = 1, group: str | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"publisher rank {rank} outside a world of {world}")
        self.store = store
        self.config = config or WeightSyncConfig()
        self.device = usable_device(self.config.arena_device)
        """Where this publisher's arenas live (`arena_device`, or the CPU in a process without a GPU)."""
        self.rank, self.world = rank, world
        self.group = group or uuid.uuid4().hex
        self.owner_id = owner_id or (store if rank == 0 else f"{store}#rank{rank}")
        self._arenas: list[_Arena] = []
        self._index: Any = None
        silence_tcp_fallback_warning()

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        return _drive(self._publish_steps(shards_of(state_dict), version))

    async def apublish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        return await _adrive(self._publish_steps(shards_of(state_dict), version))

    def publish_shards(self, shards: Mapping[str, Shard], version: int) -> PublishStats:
        return _drive(self._publish_steps(shards, version))

    async def apublish_shards(self, shards: Mapping[str, Shard], version: int) -> PublishStats:
        return await _adrive(self._publish_steps(shards, version))

    def reclaim(self) -> list[int]:
        """Drop the buffers of versions nobody reads any more (publish does this too)."""
        return _drive(self._reclaim_steps())

    async def areclaim(self) -> list[int]:
        return await _adrive(self._reclaim_steps())

    def close(self) -> None:
        """Withdraw every version from the index, drop all buffers and unlink the shared-memory
        segments."""
        _drive(self._close_steps())

    async def aclose(self) -> None:
        await _adrive(self._close_steps())

    @property
    def versions(self) -> list[int]:
        """Versions whose arenas are still registered here."""
        return sorted(a.version for a in self._arenas if a.version is not None)

    def _connect_steps(self) -> Steps:
        if self._index is None:
            what = f"weight publish of '{self.store}'"
            index = yield from _call(what, weight_index(), self.config.rpc_timeout_s)
            yield from _call(what, index.reset_owner.call_one(self.owner_id), self.config.rpc_timeout_s)
            self._index = index
        return self._index

    def _publish_steps(self, shards: Mapping[str, Shard], version: int) -> Steps:
        cfg = self.config
        start = time.perf_counter()
        what = f"weight publish of '{self.store}' v{version}" + (f" (rank {self.rank})" if self.world > 1 else "")
        layout, part, pieces = plan_part(shards, cfg.alignment)
        if layout.total_bytes == 0:
            raise WeightSyncError(f"{what}: the state dict holds no bytes")
        index = yield from self._connect_steps()
        reclaimed = list((yield from self._reclaim_steps()))
        nbytes = max(part.total_bytes, cfg.alignment)  # a rank may hold no rows at all: an arena still exists
        arena = self._free_arena(nbytes)
        while arena is None:
            if time.perf_counter() - start > cfg.transfer_timeout_s:
                raise WeightSyncError(
                    f"{what}: all {cfg.max_arenas} arenas still hold versions {self.versions} that are latest, "
                    f"being read or being published by other ranks after {cfg.transfer_timeout_s:g}s; readers "
                    f"stuck? (or raise max_arenas)"
                )
            yield _Sleep(_POLL_S)
            reclaimed += yield from self._reclaim_steps()
            arena = self._free_arena(nbytes)

        packed_at = time.perf_counter()
        memory = arena.shared.memory
        try:
            pack_part(memory, part, shards)
        except ValueError as e:
            raise WeightSyncError(f"{what}: {e}") from None
        if memory.is_cuda:
            torch.cuda.synchronize(memory.device)
        registered_at = time.perf_counter()
        used = max((p.src + p.nbytes for p in pieces), default=0)  # the trailing alignment is never read
        ranges = chunk_ranges(used, _chunk_count(used, cfg), cfg.alignment)
        arena.buffers = tuple(RDMABuffer(memory[o : o + n]) for o, n in ranges)
        arena.version = version
        done_at = time.perf_counter()
        chunks = tuple(ChunkHandle(o, n, b) for (o, n), b in zip(ranges, arena.buffers))
        handle = WeightHandle(self.store, version, layout, chunks, self.owner_id, uuid.uuid4().hex, host_identity(),
                              arena.shared.ref, pieces, self.rank, self.world, self.group)
        try:
            complete = yield from _call(what, index.publish.call_one(handle), cfg.rpc_timeout_s)
        except WeightSyncError:
            yield from self._drop_steps([arena])
            raise
        reclaimed += yield from self._reclaim_steps()  # the version just superseded, if nobody reads it
        return PublishStats(
            version=version,
            nbytes=part.total_bytes,
            total_bytes=layout.total_bytes,
            seconds=time.perf_counter() - start,
            pack_seconds=registered_at - packed_at,
            register_seconds=done_at - registered_at,
            reclaimed=tuple(sorted(reclaimed)),
            arenas=len(self._arenas),
            complete=complete,
        )

    def _free_arena(self, nbytes: int) -> _Arena | None:
        """A pooled arena holding no version and big enough, else a new one if the pool has room
        (replacing a free arena that is too small), else None. New arenas are shared with same-host
        readers unless the transport is rdma."""
        free = [a for a in self._arenas if a.version is None]
        fitting = [a for a in free if a.shared.memory.numel() >= nbytes]
        if fitting:
            return min(fitting, key=lambda a: a.shared.memory.numel())
        if free:
            self._arenas.remove(free[0])
            free[0].shared.close()
        elif len(self._arenas) >= self.config.max_arenas:
            return None
        share = self.config.transport != "rdma"
        arena = _Arena(SharedArena(nbytes, self.device, share))
        self._arenas.append(arena)
        return arena

    def _reclaim_steps(self) -> Steps:
        index = yield from self._connect_steps()
        held = self.versions
        if not held:
            return []
        what = f"weight publish of '{self.store}'"
        reclaim = index.reclaim.call_one(self.owner_id, held, self.config.keep_versions)
        droppable = yield from _call(what, reclaim, self.config.rpc_timeout_s)
        yield from self._drop_steps([a for a in self._arenas if a.version in droppable])
        return droppable

    def _drop_steps(self, arenas: list[_Arena]) -> Steps:
        futures = [b.drop() for a in arenas for b in a.buffers]
        if futures:
            outcomes = yield _AwaitAll(futures, self.config.rpc_timeout_s)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                warnings.warn(
                    f"weight store '{self.store}': {len(failed)} RDMA buffer drops failed: {_one_line(failed[0])}"
                )
        for a in arenas:
            a.buffers, a.version = (), None

    def _close_steps(self) -> Steps:
        try:
            if self._index is not None:
                what = f"weight publisher '{self.store}' close"
                yield from _call(what, self._index.reset_owner.call_one(self.owner_id), self.config.rpc_timeout_s)
            yield from self._drop_steps(self._arenas)
        finally:  # segments are unlinked even when the index is unreachable
            for a in self._arenas:
                a.shared.close()
            self._arenas.clear()


# ---------------------------------------------------------------------------------------- puller


class WeightPuller:
    """Pulls the newest version of one store (or an exact one), assembled from every publishing rank.

    ``pull(min_version, timeout_s)`` fills this process's own arena and returns views of it;
    ``pull_into(load, ...)`` hands the version to ``load`` bucket by bucket (``pull_bucket_mib``,
    whole decoder layers), optionally only ``slices`` of the tensors; ``await apull(...)`` /
    ``apull_into`` from async actors. A pull waits up to ``timeout_s`` (default
    ``transfer_timeout_s``) for a version >= ``min_version``; when the newest version is the one
    already held it returns at once without transferring. With ``exact=True`` it pulls version
    ``min_version`` itself, older or newer than the one held (the publisher keeps
    `keep_versions` of them); a version that is superseded but gone raises at once. The transport
    follows ``config.transport`` and each part's host; each change is logged.
    """

    def __init__(self, store: str, config: WeightSyncConfig | None = None) -> None:
        self.store = store
        self.config = config or WeightSyncConfig()
        self.device = usable_device(self.config.arena_device)
        """Where this reader's buffers live (`arena_device`, or the CPU in a process without a GPU)."""
        self.version: int | None = None
        """The version the arena (``pull``) or the loader (``pull_into``) holds; None while a failed
        pull left it incomplete."""
        self._publish_id: str | None = None  # identifies the bytes the arena / loader holds
        self._arena: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._views_layout = None
        self._bucket: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._stranded: list[torch.Tensor] = []  # buffers a read may still write into: never reused
        self._index: Any = None
        self._same_host = SameHostReader(cuda_handles=self.config.max_arenas)
        self._transport: str | None = None  # of the last transfer, to log changes

    def pull(self, min_version: int = 0, timeout_s: float | None = None, exact: bool = False) -> PullResult:
        return _drive(self._pull_steps(min_version, timeout_s, exact))

    async def apull(self, min_version: int = 0, timeout_s: float | None = None, exact: bool = False) -> PullResult:
        return await _adrive(self._pull_steps(min_version, timeout_s, exact))

    def pull_into(self, load: Loader, min_version: int = 0, timeout_s: float | None = None, exact: bool = False,
                  slices: Slicer | None = None, elsewhere: Elsewhere | None = None) -> PullResult:
        return _drive(self._pull_steps(min_version, timeout_s, exact, load, slices, elsewhere))

    async def apull_into(self, load: Loader, min_version: int = 0, timeout_s: float | None = None,
                         exact: bool = False, slices: Slicer | None = None,
                         elsewhere: Elsewhere | None = None) -> PullResult:
        return await _adrive(self._pull_steps(min_version, timeout_s, exact, load, slices, elsewhere))

    def _pull_steps(self, min_version: int, timeout_s: float | None, exact: bool, load: Loader | None = None,
                    slices: Slicer | None = None, elsewhere: Elsewhere | None = None) -> Steps:
        cfg = self.config
        start = time.perf_counter()
        what = f"weight pull of '{self.store}'"
        self._same_host.drop_unlinked()
        if self._index is None:
            self._index = yield from _call(what, weight_index(), cfg.rpc_timeout_s)
        wait_s = cfg.transfer_timeout_s if timeout_s is None else timeout_s
        read_timeout = max(1, math.ceil(cfg.transfer_timeout_s))
        lease_s = read_timeout + _DRIVER_SLACK_S + 2 * cfg.rpc_timeout_s
        acquire = self._index.acquire.call_one(self.store, min_version, self._publish_id, wait_s, lease_s, exact)
        got = yield from _call(what, acquire, wait_s + cfg.rpc_timeout_s)
        if got is None:
            stats = PullStats(time.perf_counter() - start, 0.0, 0, "none")
            return PullResult(self.version, self._views if load is None else {}, stats)  # type: ignore[arg-type]
        handle, lease = got
        what = f"weight pull of '{self.store}' v{handle.version}"
        release = (self.store, handle.version, lease)
        self.version = self._publish_id = None  # being overwritten: invalid until this pull succeeds
        try:
            if load is None:
                fill = yield from self._arena_steps(handle, read_timeout, what)
            else:
                fill = yield from self._bucket_steps(handle, load, slices, elsewhere, read_timeout, what)
        except BaseException:
            try:  # best effort: the lease also expires on its own
                yield from _call(what, self._index.release.call_one(*release), cfg.rpc_timeout_s)
            except WeightSyncError:
                pass
            raise
        intact = yield from _call(what, self._index.release.call_one(*release), cfg.rpc_timeout_s)
        if not intact:
            raise WeightSyncError(f"{what}: the version was reclaimed mid-transfer (lease expired after {lease_s:g}s)")
        self.version, self._publish_id = handle.version, handle.publish_id
        stats = PullStats(time.perf_counter() - start, **fill)
        return PullResult(handle.version, self._views if load is None else {}, stats)

    def _arena_steps(self, handle: VersionHandle, read_timeout: int, what: str) -> Steps:
        """The whole version into this reader's arena; its views become ``self._views``."""
        nbytes = handle.layout.total_bytes
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena, self._views_layout = allocate_arena(nbytes, self.device), None
        began = time.perf_counter()
        transport, read = yield from self._fill_steps(handle, whole_bucket(handle.layout), self._arena,
                                                      _STAGING_BYTES, read_timeout, what)
        if self._views_layout != handle.layout:
            self._views, self._views_layout = views(self._arena, handle.layout), handle.layout
        return {"transfer_seconds": time.perf_counter() - began, "nbytes": nbytes, "transport": transport,
                "read_bytes": read}

    def _bucket_steps(self, handle: VersionHandle, load: Loader, slices: Slicer | None, elsewhere: Elsewhere | None,
                      read_timeout: int, what: str) -> Steps:
        """The version bucket by bucket into ``load``; the bucket buffer is reused. A bucket whose
        parts are all on this host goes to ``elsewhere`` as a :class:`HostFill` when given (its
        loader fills it straight out of the publishers' arenas; transport ``worker_shm`` /
        ``worker_cuda_ipc``), unless ``elsewhere`` declines it."""
        bucket_bytes = self.config.pull_bucket_mib << 20 or handle.layout.total_bytes
        cuts = slices({m.name: m.shape for m in handle.layout.tensors}) if slices is not None else None
        buckets = plan_buckets(handle.layout, bucket_bytes, cuts)
        transfer_s = load_s = 0.0
        transports, read = set(), 0
        for bucket in buckets:
            began = time.perf_counter()
            plan = self._host_fill(handle, bucket) if elsewhere is not None else None
            if plan is not None and (yield _Run(functools.partial(elsewhere, plan))):
                transports.add(f"worker_{plan.transport}")
                read += sum(m.copied_bytes for _, part_moves in plan.parts for m in part_moves)
                load_s += time.perf_counter() - began
                self._log_transport(f"worker_{plan.transport}", None)
                continue
            if self._bucket is None or self._bucket.numel() < bucket.nbytes:
                self._bucket = allocate_arena(max(b.nbytes for b in buckets), self.device)
            transport, n = yield from self._fill_steps(handle, bucket, self._bucket, bucket_bytes, read_timeout, what)
            transports.update(transport.split("+"))
            read += n
            loaded_at = time.perf_counter()
            yield _Run(functools.partial(load, list(views(self._bucket, bucket.layout).items())))
            transfer_s += loaded_at - began
            load_s += time.perf_counter() - loaded_at
        return {"transfer_seconds": transfer_s, "nbytes": sum(b.nbytes for b in buckets),
                "transport": "+".join(sorted(transports)), "read_bytes": read, "load_seconds": load_s,
                "buckets": len(buckets)}

    def _host_fill(self, handle: VersionHandle, bucket: Bucket) -> HostFill | None:
        """``bucket`` as a :class:`HostFill` when the transport config lets every part it reads be
        copied on this host; None otherwise (then it is filled here, over RDMA where needed)."""
        parts, used = [], set()
        for i, part_moves in _moves_by_part(handle, bucket).items():
            part = handle.parts[i]
            try:
                transport = local_transport(self.config.transport, part.host, part.local)
            except SameHostUnavailable:
                return None  # _fill_steps raises it under transport shm, or falls back to RDMA
            if transport is None:
                return None
            parts.append((part.local, tuple(part_moves)))
            used.add(transport)
        if len(used) != 1:
            return None
        return HostFill(bucket.layout, bucket.nbytes, tuple(parts), used.pop())

    def _fill_steps(self, handle: VersionHandle, bucket: Bucket, dst: torch.Tensor, staging_bytes: int,
                    read_timeout: int, what: str) -> Steps:
        """Fill ``dst`` with ``bucket`` from every part: one local copy per part on this host when
        the transport config allows it, else RDMA (also when a local arena cannot be opened under
        transport auto). Returns (transports joined by "+", bytes read)."""
        transports, remote, read, fallback = set(), [], 0, None
        for i, part_moves in _moves_by_part(handle, bucket).items():
            part = handle.parts[i]
            try:
                transport = local_transport(self.config.transport, part.host, part.local)
                if transport is not None:
                    yield _Run(functools.partial(self._same_host.copy_moves, part.local, dst, part_moves))
                    transports.add(transport)
                    read += sum(m.copied_bytes for m in part_moves)
                    continue
            except OwnerGone as e:
                raise WeightSyncError(f"{what} failed: {e}") from None
            except SameHostUnavailable as e:
                if self.config.transport == "shm":
                    raise WeightSyncError(f"{what} failed: {e}") from None
                fallback = e
            remote.append((part, part_moves))
        if "cuda_ipc" in transports:
            yield _Run(self._same_host.synchronize)  # once per fill, before the publisher may reuse its arena
        if remote:
            read += yield from self._rdma_steps(remote, dst, staging_bytes, read_timeout, what)
            transports.add("rdma")
        used = "+".join(sorted(transports))
        self._log_transport(used, fallback)
        return used, read

    def _log_transport(self, transport: str, fallback: BaseException | None) -> None:
        if transport == self._transport:
            return
        self._transport = transport
        if fallback is None:
            logger.info("weight pulls of '%s' now use %s", self.store, transport)
        else:
            logger.warning("weight pulls of '%s' now use %s: %s", self.store, transport, _one_line(fallback))

    def _rdma_steps(self, remote: list[tuple[WeightHandle, list[Move]]], dst: torch.Tensor, staging_bytes: int,
                    read_timeout: int, what: str) -> Steps:
        """Read the parts' chunks: straight into ``dst`` where a chunk lies inside one copy, the
        others wave by wave through a staging buffer. Returns the bytes read."""
        plans = []
        for part, part_moves in remote:
            direct, waves = rdma_plan([(c.offset, c.nbytes) for c in part.chunks], part_moves, staging_bytes)
            plans.append((part, direct, waves))
        size = max((w.nbytes for _, _, waves in plans for w in waves), default=0)
        if size and (self._staging is None or self._staging.numel() < size):
            self._staging = allocate_arena(size, self.device)
        staging = self._staging
        pending = [(part.chunks[c], dst[d : d + part.chunks[c].nbytes]) for part, direct, _ in plans for c, d in direct]
        read = sum(chunk.nbytes for chunk, _ in pending)
        rounds = [(part, w) for part, _, waves in plans for w in waves] or [None]
        for step in rounds:
            if step is not None:
                part, wave = step
                offset = 0
                for c in wave.chunks:
                    chunk = part.chunks[c]
                    pending.append((chunk, staging[offset : offset + chunk.nbytes]))
                    offset += chunk.nbytes
                read += wave.nbytes
            yield from self._read_steps(pending, [dst] + ([staging] if staging is not None else []),
                                        read_timeout, what)
            pending = []
            if step is not None:
                yield _Run(functools.partial(_apply_all, staging, dst, wave.copies))
        return read

    def _read_steps(self, reads: list[tuple[ChunkHandle, torch.Tensor]], targets: list[torch.Tensor],
                    read_timeout: int, what: str) -> Steps:
        """Issue every read at once and wait; a read that outlived its deadline may still write into
        ``targets`` later, so they are never reused."""
        if not reads:
            return
        began = time.perf_counter()
        futures = [chunk.buffer.read_into(into, timeout=read_timeout) for chunk, into in reads]
        outcomes = yield _AwaitAll(futures, read_timeout + _DRIVER_SLACK_S)
        elapsed = time.perf_counter() - began
        for i, outcome in enumerate(outcomes):
            if not isinstance(outcome, BaseException):
                continue
            if any(isinstance(o, TimeoutError) for o in outcomes):
                self._strand(targets)
            chunk = f"chunk {i + 1}/{len(outcomes)}"
            if isinstance(outcome, TimeoutError) or "timed out" in str(outcome):
                raise WeightSyncError(f"{what} {chunk} timed out after {elapsed:.1f}s: owner gone?") from None
            raise WeightSyncError(f"{what} {chunk} failed: {_one_line(outcome)}") from None

    def _strand(self, targets: list[torch.Tensor]) -> None:
        self._stranded += targets
        for name in ("_arena", "_bucket", "_staging"):
            if any(getattr(self, name) is t for t in targets):
                setattr(self, name, None)
        self._views_layout = None


def _moves_by_part(handle: VersionHandle, bucket: Bucket) -> dict[int, list[Move]]:
    """The copies that fill ``bucket``, by the publishing part (rank) they read from."""
    by_part: dict[int, list[Move]] = {}
    for m in moves(bucket, [p.pieces for p in handle.parts]):
        by_part.setdefault(m.part, []).append(m)
    return by_part


def _apply_all(src: torch.Tensor, dst: torch.Tensor, copies: tuple[Move, ...]) -> None:
    for m in copies:
        apply_move(src, dst, m)
