"""Versioned weight store: the learner publishes state dicts, generators pull them by a path chosen
by locality: a copy out of the publisher's shared memory (CPU) or CUDA IPC handle (GPU) when they
run on its host (``meshrl.transport.same_host``), ``monarch.rdma.RDMABuffer`` reads otherwise
(ibverbs on GPU hosts, the TCP fallback on CPU).

The TorchStore design (index + data owners + RDMA handles), rebuilt for Monarch 0.7:

* ``WeightIndex`` (in ``weight_index.py``) - a light all-async actor, one named singleton in the
  controller process (``get_or_spawn_controller("meshrl.weight_index", WeightIndex)``). Per store it keeps the
  published ``WeightHandle``s (layout + chunk RDMA buffers), the read leases and the latest version.
* ``WeightPublisher`` - a plain object inside the data owner (the learner's process). Each version is
  packed into a flat arena from a small pool (CPU arenas in named shared memory, CUDA arenas exported
  for CUDA IPC), registered as ``num_chunks`` RDMA buffers and announced to the index with the
  owner's host identity. Versions that are not among the ``keep_versions`` newest and unleased are
  reclaimed: their buffers are dropped (stale handles then fail instead of reading other bytes) and
  the arena is reused.
* ``WeightPuller`` - a plain object inside each reader. A pull leases the newest (or an exact)
  version, fills the reader's own arena (one local copy on the publisher's host under ``transport``
  auto or shm, else all chunks read concurrently over RDMA), releases the lease and returns
  zero-copy views.

Both objects offer a sync method (for sync actor endpoints and plain scripts) and an ``a``-prefixed
coroutine (for async actors; ``.get()`` would block their event loop). Both variants run the same
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
            result = self.weights.pull(min_version)  # no transfer if already at the latest version
            if result.stats.nbytes:
                copy_tensors(self.model.state_dict(), result.tensors)  # or hand the views to vLLM
            return result.version
"""

from __future__ import annotations

import functools
import logging
import math
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from monarch.actor import ActorError
from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

from meshrl.transport.arena import ArenaLayout, allocate_arena, chunk_ranges, pack_into, views
from meshrl.transport.same_host import (
    LocalRef,
    OwnerGone,
    SameHostReader,
    SameHostUnavailable,
    SharedArena,
    host_identity,
    local_transport,
)
from meshrl.transport.weight_index import ChunkHandle, WeightHandle, WeightSyncError, weight_index
from meshrl.transport.steps import Steps, _adrive, _Await, _AwaitAll, _drive, _one_line, _Run, _Sleep
from meshrl.config.weight_sync import WeightSyncConfig

_POLL_S = 0.05  # publisher re-checks for a free arena this often while all are leased
_DRIVER_SLACK_S = 5.0  # extra wait beyond the RDMA layer's own timeout before giving up on a read

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishStats:
    version: int
    nbytes: int
    seconds: float
    pack_seconds: float
    register_seconds: float
    reclaimed: tuple[int, ...]
    """Versions whose buffers this publish dropped (superseded and no longer read)."""
    arenas: int
    """Arenas in the publisher's pool after this publish."""


@dataclass(frozen=True)
class PullStats:
    seconds: float
    """Whole pull: lease, transfer and release."""
    transfer_seconds: float
    nbytes: int
    """Bytes transferred (0 when the reader already had the latest version)."""
    transport: str
    """How they moved: "shm", "cuda_ipc", "rdma", or "none" when nothing moved."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PullResult:
    version: int
    tensors: dict[str, torch.Tensor]
    """Zero-copy views into the puller's arena: valid, and the same objects, until the next pull
    that transfers (which overwrites them in place)."""
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


# ------------------------------------------------------------------------------------- publisher


@dataclass
class _Arena:
    shared: SharedArena
    version: int | None = None
    buffers: tuple[RDMABuffer, ...] = ()


class WeightPublisher:
    """Publishes state dicts of one store from the process that owns the weights (the learner).

    ``publish(state_dict, version)`` from sync code, ``await apublish(...)`` from async actors.
    ``owner_id`` names this data owner in the index (default: the store name); a new publisher with
    the same id forgets its predecessor's versions on first use, as after a learner restart.
    """

    def __init__(self, store: str, config: WeightSyncConfig | None = None, owner_id: str | None = None) -> None:
        self.store = store
        self.config = config or WeightSyncConfig()
        self.owner_id = owner_id or store
        self._arenas: list[_Arena] = []
        self._layout: ArenaLayout | None = None
        self._index: Any = None
        silence_tcp_fallback_warning()

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        return _drive(self._publish_steps(state_dict, version))

    async def apublish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        return await _adrive(self._publish_steps(state_dict, version))

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

    def _publish_steps(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Steps:
        cfg = self.config
        start = time.perf_counter()
        what = f"weight publish of '{self.store}' v{version}"
        if self._layout is not None and self._layout.matches(state_dict):
            layout = self._layout
        else:
            layout = ArenaLayout.from_state_dict(state_dict, cfg.alignment)
        if layout.total_bytes == 0:
            raise WeightSyncError(f"{what}: the state dict holds no bytes")
        index = yield from self._connect_steps()
        reclaimed = list((yield from self._reclaim_steps()))
        arena = self._free_arena(layout.total_bytes)
        while arena is None:
            if time.perf_counter() - start > cfg.transfer_timeout_s:
                raise WeightSyncError(
                    f"{what}: all {cfg.max_arenas} arenas still hold versions {self.versions} that are latest "
                    f"or being read after {cfg.transfer_timeout_s:g}s; readers stuck? (or raise max_arenas)"
                )
            yield _Sleep(_POLL_S)
            reclaimed += yield from self._reclaim_steps()
            arena = self._free_arena(layout.total_bytes)

        packed_at = time.perf_counter()
        memory = arena.shared.memory
        pack_into(memory, state_dict, layout)
        if memory.is_cuda:
            torch.cuda.synchronize(memory.device)
        registered_at = time.perf_counter()
        ranges = chunk_ranges(layout.total_bytes, cfg.num_chunks, cfg.alignment)
        arena.buffers = tuple(RDMABuffer(memory[o : o + n]) for o, n in ranges)
        arena.version = version
        done_at = time.perf_counter()
        chunks = tuple(ChunkHandle(o, n, b) for (o, n), b in zip(ranges, arena.buffers))
        handle = WeightHandle(
            self.store, version, layout, chunks, self.owner_id, uuid.uuid4().hex, host_identity(), arena.shared.ref
        )
        try:
            yield from _call(what, index.publish.call_one(handle), cfg.rpc_timeout_s)
        except WeightSyncError:
            yield from self._drop_steps([arena])
            raise
        self._layout = layout
        reclaimed += yield from self._reclaim_steps()  # the version just superseded, if nobody reads it
        return PublishStats(
            version=version,
            nbytes=layout.total_bytes,
            seconds=time.perf_counter() - start,
            pack_seconds=registered_at - packed_at,
            register_seconds=done_at - registered_at,
            reclaimed=tuple(sorted(reclaimed)),
            arenas=len(self._arenas),
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
        arena = _Arena(SharedArena(nbytes, self.config.arena_device, share))
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
    """Pulls the newest version of one store (or an exact one) into this process's own arena.

    ``pull(min_version, timeout_s)`` from sync code, ``await apull(...)`` from async actors. A pull
    waits up to ``timeout_s`` (default ``transfer_timeout_s``) for a version >= ``min_version``;
    when the newest version is the one already held it returns at once without transferring. With
    ``exact=True`` it pulls version ``min_version`` itself, older or newer than the one held (the
    publisher keeps `keep_versions` of them); a version that is superseded but gone raises at
    once. The transport follows ``config.transport`` and the publisher's host; each change is logged.
    """

    def __init__(self, store: str, config: WeightSyncConfig | None = None) -> None:
        self.store = store
        self.config = config or WeightSyncConfig()
        self.version: int | None = None
        self._publish_id: str | None = None  # identifies the bytes in the arena
        self._arena: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._views_layout: ArenaLayout | None = None
        self._stranded: list[torch.Tensor] = []  # arenas a read may still write into: never reused
        self._index: Any = None
        self._same_host = SameHostReader()
        self._transport: str | None = None  # of the last transfer, to log changes

    def pull(self, min_version: int = 0, timeout_s: float | None = None, exact: bool = False) -> PullResult:
        return _drive(self._pull_steps(min_version, timeout_s, exact))

    async def apull(self, min_version: int = 0, timeout_s: float | None = None, exact: bool = False) -> PullResult:
        return await _adrive(self._pull_steps(min_version, timeout_s, exact))

    def _pull_steps(self, min_version: int, timeout_s: float | None, exact: bool) -> Steps:
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
            return PullResult(self.version, self._views, stats)  # type: ignore[arg-type]
        handle, lease = got
        what = f"weight pull of '{self.store}' v{handle.version}"
        release = (self.store, handle.version, lease)
        try:
            transport, transfer_s = yield from self._transfer_steps(handle, read_timeout, what)
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
        if self._views_layout != handle.layout:
            self._views, self._views_layout = views(self._arena, handle.layout), handle.layout
        stats = PullStats(time.perf_counter() - start, transfer_s, handle.layout.total_bytes, transport)
        return PullResult(handle.version, self._views, stats)

    def _transfer_steps(self, handle: WeightHandle, read_timeout: int, what: str) -> Steps:
        """Fill this reader's arena with the version's bytes: one local copy when the transport
        config and the publisher's host allow it, else concurrent RDMA chunk reads (also when the
        local arena cannot be opened under transport auto). Returns (transport, seconds)."""
        nbytes = handle.layout.total_bytes
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena, self._views_layout = allocate_arena(nbytes, self.config.arena_device), None
        arena = self._arena
        self.version = self._publish_id = None  # arena being overwritten: invalid until this pull succeeds
        began = time.perf_counter()
        fallback = None
        try:
            transport = local_transport(self.config.transport, handle.host, handle.local)
            if transport is not None:
                yield _Run(functools.partial(self._same_host.copy, handle.local, arena, nbytes))
                self._log_transport(transport, None)
                return transport, time.perf_counter() - began
        except OwnerGone as e:
            raise WeightSyncError(f"{what} failed: {e}") from None
        except SameHostUnavailable as e:
            if self.config.transport == "shm":
                raise WeightSyncError(f"{what} failed: {e}") from None
            fallback = e
        yield from self._rdma_steps(handle, arena, read_timeout, what)
        self._log_transport("rdma", fallback)
        return "rdma", time.perf_counter() - began

    def _log_transport(self, transport: str, fallback: BaseException | None) -> None:
        if transport == self._transport:
            return
        self._transport = transport
        if fallback is None:
            logger.info("weight pulls of '%s' now use %s", self.store, transport)
        else:
            logger.warning("weight pulls of '%s' now use rdma: %s", self.store, _one_line(fallback))

    def _rdma_steps(self, handle: WeightHandle, arena: torch.Tensor, read_timeout: int, what: str) -> Steps:
        began = time.perf_counter()
        reads = [c.buffer.read_into(arena[c.offset : c.offset + c.nbytes], timeout=read_timeout) for c in handle.chunks]
        outcomes = yield _AwaitAll(reads, read_timeout + _DRIVER_SLACK_S)
        elapsed = time.perf_counter() - began
        for i, outcome in enumerate(outcomes):
            if not isinstance(outcome, BaseException):
                continue
            if any(isinstance(o, TimeoutError) for o in outcomes):  # a read outlived its own deadline
                self._stranded.append(arena)
                self._arena = None
            chunk = f"chunk {i + 1}/{len(outcomes)}"
            if isinstance(outcome, TimeoutError) or "timed out" in str(outcome):
                raise WeightSyncError(f"{what} {chunk} timed out after {elapsed:.1f}s: owner gone?") from None
            raise WeightSyncError(f"{what} {chunk} failed: {_one_line(outcome)}") from None
