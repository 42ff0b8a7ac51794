"""PolicyFollower: how a weight reader (generator, SDPO teacher) keeps its engine on the learner's
latest version — pull from the weight store, merge a LoRA adapter into the base weights when only
the adapter was published, load into the engine between requests; or, for an engine that applies
adapters per request, keep each version's adapter on a shelf (`AdapterShelf`)."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter, OrderedDict
from pathlib import Path

import torch

from meshrl.transport import in_process
from meshrl.transport.weight_index import WeightSyncError
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.transport.same_host import HostFill
from meshrl.transport.shards import layer_group
from meshrl.transport.weight_store import WeightPuller
from meshrl.engines.base import Adapter
from meshrl.training.lora import is_adapter, load_base_state, merge_adapter, write_peft_adapter


def require_complete(follower) -> None:
    """Refuse to serve from an engine a failed bucketed pull left half overwritten."""
    if follower.version is None:
        raise WeightSyncError("the engine's weights are incomplete after a failed weight pull: call update_weights "
                              "(it pulls the whole version again)")


class PolicyFollower:
    """Owns the puller and (for adapter-only sync) the base weights adapters are merged into."""

    def __init__(self, store: str, sync_cfg: WeightSyncConfig, model_path: Path):
        self.puller = WeightPuller(store, sync_cfg)
        self.bucketed = sync_cfg.pull_bucket_mib > 0
        self._rank_pullers: list[WeightPuller] = []  # ranks 1.. of a tensor-parallel engine (rank 0's is `puller`)
        self.model_path = Path(model_path)
        self._base = None
        self.version: int | None = 0
        """The version the engine holds; None while a failed bucketed pull left it incomplete."""

    def update(self, engine, min_version: int, exact: bool = False) -> dict:
        """Pull the newest version >= ``min_version`` (``exact``: that version itself) and load it
        into ``engine`` (nothing moves when the engine already holds it): bucket by bucket under
        ``weight_sync.pull_bucket_mib``, else whole into the puller's arena first; into a
        tensor-parallel engine, each worker's own slices into that worker."""
        try:
            if getattr(engine, "tensor_parallel_size", 1) > 1:
                result, load_s = self._pull_rank_slices(engine, min_version, exact)
            elif self.bucketed:
                result = self.puller.pull_into(functools.partial(self._load, engine), min_version, exact=exact)
                load_s = result.stats.load_seconds
            else:
                result = self.puller.pull(min_version, exact=exact)
                started = time.perf_counter()
                if result.stats.nbytes:
                    self._load(engine, list(result.tensors.items()))
                load_s = time.perf_counter() - started
        except BaseException:
            if any(p.version is None for p in (self.puller, *self._rank_pullers)):
                self.version = None  # the engine (or the arena it loads from) was being overwritten
            raise
        self.version = result.version
        return {"version": result.version, "pull_s": result.stats.seconds,
                "transfer_s": result.stats.transfer_seconds, "bytes": result.stats.nbytes, "load_s": load_s,
                "transport": result.stats.transport}

    def _pull_rank_slices(self, engine, min_version: int, exact: bool):
        """A tensor-parallel engine: each rank's puller pulls only the slices that rank's worker
        loads (``engine.rank_slices``), bucket by bucket into that worker alone; rank 0 takes the
        newest version >= ``min_version`` (or ``exact``), the other ranks that same version. Without
        ``pull_bucket_mib`` a rank's share is one bucket. On the publishers' host a worker copies
        its buckets out of their arenas itself (``engine.fill_rank``; transport ``worker_shm``)."""
        ranks = engine.tensor_parallel_size
        while len(self._rank_pullers) < ranks - 1:
            self._rank_pullers.append(WeightPuller(self.puller.store, self.puller.config))
        pullers = [self.puller, *self._rank_pullers[: ranks - 1]]
        results = []
        for rank, puller in enumerate(pullers):
            version, rank_exact = (min_version, exact) if rank == 0 else (results[0].version, True)
            results.append(puller.pull_into(functools.partial(self._load, engine, rank=rank), version,
                                            exact=rank_exact, slices=functools.partial(engine.rank_slices, rank),
                                            elsewhere=functools.partial(self._hand_off, engine, rank)))
        stats = [r.stats for r in results]
        merged = dataclasses.replace(
            stats[0], seconds=sum(s.seconds for s in stats), transfer_seconds=sum(s.transfer_seconds for s in stats),
            nbytes=sum(s.nbytes for s in stats), read_bytes=sum(s.read_bytes for s in stats),
            buckets=sum(s.buckets for s in stats),
            transport="+".join(sorted({t for s in stats if s.nbytes for t in s.transport.split("+")})) or "none")
        return dataclasses.replace(results[0], stats=merged), sum(s.load_seconds for s in stats)

    def _hand_off(self, engine, rank: int, plan: HostFill) -> bool:
        """Have tensor-parallel ``rank``'s worker fill and load ``plan`` itself; an adapter's bucket
        is declined (it is merged into the base weights here first)."""
        if is_adapter(m.name for m in plan.layout.tensors):
            return False
        engine.fill_rank(rank, plan, self.puller.config.transfer_timeout_s)
        return True

    def _load(self, engine, items: list[tuple[str, torch.Tensor]], rank: int | None = None) -> None:
        """Load pulled tensors into ``engine`` (into tensor-parallel ``rank``'s worker alone when
        given); an adapter (``lora.sync: adapter``) is merged into the base weights of the layers it
        adapts first, and those whole layers are loaded."""
        tensors = dict(items)
        if is_adapter(tensors):
            if self._base is None:
                # float32: a bf16 base would round W0 + scale * B @ A to bf16 before the engine
                # sees it, losing small adapter updates even in a float32 engine; the engine
                # casts to its own dtype on load
                self._base = load_base_state(self.model_path, torch.float32)
            layers = {layer_group(k.removesuffix(".lora_A") + ".weight") for k in tensors if k.endswith(".lora_A")}
            tensors = merge_adapter({k: v for k, v in self._base.items() if layer_group(k) in layers}, tensors)
        if rank is None:
            engine.load_weights(tensors.items())
        else:
            engine.load_rank_weights(rank, tensors.items())


class AdapterShelf:
    """The weight versions an engine that applies adapters itself (`generator.lora_slots`) samples
    with: each version's adapter pulled from the store once, written as a PEFT directory and loaded
    into the engine's adapter cache. Past ``capacity`` versions, the least recently used with no
    request in flight is dropped (from the engine too), so a long-lived server keeps a bounded set;
    a dropped version is pulled again when asked for."""

    def __init__(self, store: str, sync_cfg: WeightSyncConfig, engine, capacity: int):
        self.puller = WeightPuller(store, sync_cfg)
        self.engine, self.capacity = engine, capacity
        self.root = Path(tempfile.mkdtemp(prefix="meshrl-adapters-"))
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self._held: OrderedDict[int, Adapter] = OrderedDict()
        self._using: Counter[int] = Counter()  # requests in flight per version
        self._lock = threading.Lock()  # `release` runs on the engine's thread
        self._pulling = threading.Lock()  # one version pulled at a time

    def acquire(self, version: int) -> Adapter:
        """Weight ``version``'s adapter, held for one request until `release` (pulled and loaded
        first when not held). Raises what the pull raises (a WeightSyncError when the publisher no
        longer keeps it) or what the engine raises for it (a rank over its limit)."""
        with self._pulling:
            with self._lock:
                if version in self._held:
                    self._held.move_to_end(version)
                    self._using[version] += 1
                    return self._held[version]
            result = self.puller.pull(version, exact=True)
            directory = self.root / f"v{version}"
            try:
                adapter = Adapter(version + 1, directory, *write_peft_adapter(result.tensors, directory))
                self.engine.add_adapter(adapter)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            return self._shelve(version, adapter)

    def _shelve(self, version: int, adapter: Adapter) -> Adapter:
        with self._lock:
            self._held[version] = adapter
            self._using[version] += 1
            idle = [v for v in self._held if not self._using[v]][: max(0, len(self._held) - self.capacity)]
            dropped = [self._held.pop(v) for v in idle]
        for old in dropped:
            self.engine.remove_adapter(old.id)
            shutil.rmtree(old.path, ignore_errors=True)
        return adapter

    def release(self, version: int) -> None:
        """One request under ``version`` is done."""
        with self._lock:
            self._using[version] -= 1

    def held(self) -> list[int]:
        """The versions held, least recently used first."""
        with self._lock:
            return list(self._held)


class InProcessFollower:
    """A co-located reader's follower: the learner shares its module in this process
    (meshrl.transport.in_process). An engine built on that module (``shares``) holds every version
    the moment it is published: an update moves nothing. Other engines copy the learner's
    inference weights in-process through their reload."""

    def __init__(self, store: str, timeout_s: float, shares: bool, loaded: bool = True):
        """``loaded``: the engine already holds version 0 (the model it was built from); False for an
        engine built with dummy weights, which then copies even version 0."""
        self.store, self.timeout_s, self.shares = store, timeout_s, shares
        self.version = 0 if loaded else -1

    def update(self, engine, min_version: int, exact: bool = False) -> dict:
        source = in_process.wait_for(self.store, self.timeout_s, min_version)
        if exact and source.version != min_version:
            raise WeightSyncError(f"version {min_version} is gone: a co-located engine holds only the learner's "
                                  f"current weights (version {source.version})")
        started, nbytes = time.perf_counter(), 0
        if not self.shares and source.version != self.version:
            state = source.state()
            engine.load_weights(state.items())
            nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
        self.version = source.version
        return {"version": source.version, "pull_s": 0.0, "transfer_s": 0.0, "bytes": nbytes,
                "load_s": time.perf_counter() - started, "transport": "shared" if self.shares else "in_process"}
