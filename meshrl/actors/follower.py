"""PolicyFollower: how a weight reader (generator, SDPO teacher) keeps its engine on the learner's
latest version — pull from the weight store, merge a LoRA adapter into the base weights when only
the adapter was published, load into the engine between requests."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from meshrl.transport import in_process
from meshrl.transport.weight_index import WeightSyncError
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.transport.shards import layer_group
from meshrl.transport.weight_store import WeightPuller
from meshrl.training.lora import is_adapter, load_base_state, merge_adapter


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
        self.model_path = Path(model_path)
        self._base = None
        self.version: int | None = 0
        """The version the engine holds; None while a failed bucketed pull left it incomplete."""

    def update(self, engine, min_version: int, exact: bool = False) -> dict:
        """Pull the newest version >= ``min_version`` (``exact``: that version itself) and load it
        into ``engine`` (nothing moves when the engine already holds it): bucket by bucket under
        ``weight_sync.pull_bucket_mib``, else whole into the puller's arena first."""
        try:
            if self.bucketed:
                result = self.puller.pull_into(functools.partial(self._load, engine), min_version, exact=exact)
                load_s = result.stats.load_seconds
            else:
                result = self.puller.pull(min_version, exact=exact)
                started = time.perf_counter()
                if result.stats.nbytes:
                    self._load(engine, list(result.tensors.items()))
                load_s = time.perf_counter() - started
        except BaseException:
            if self.puller.version is None:  # the engine (or the arena it loads from) was being overwritten
                self.version = None
            raise
        self.version = result.version
        return {"version": result.version, "pull_s": result.stats.seconds,
                "transfer_s": result.stats.transfer_seconds, "bytes": result.stats.nbytes, "load_s": load_s,
                "transport": result.stats.transport}

    def _load(self, engine, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load pulled tensors into ``engine``; an adapter (``lora.sync: adapter``) is merged into
        the base weights of the layers it adapts first, and those whole layers are loaded."""
        tensors = dict(items)
        if is_adapter(tensors):
            if self._base is None:
                # float32: a bf16 base would round W0 + scale * B @ A to bf16 before the engine
                # sees it, losing small adapter updates even in a float32 engine; the engine
                # casts to its own dtype on load
                self._base = load_base_state(self.model_path, torch.float32)
            layers = {layer_group(k.removesuffix(".lora_A") + ".weight") for k in tensors if k.endswith(".lora_A")}
            tensors = merge_adapter({k: v for k, v in self._base.items() if layer_group(k) in layers}, tensors)
        engine.load_weights(tensors.items())


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
