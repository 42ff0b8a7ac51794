"""PolicyFollower: how a weight reader (generator, SDPO teacher) keeps its engine on the learner's
latest version — pull from the weight store, merge a LoRA adapter into the base weights when only
the adapter was published, load into the engine between requests."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from meshrl.transport import in_process
from meshrl.transport.weight_index import WeightSyncError
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.transport.weight_store import WeightPuller
from meshrl.training.lora import is_adapter, load_base_state, merge_adapter


class PolicyFollower:
    """Owns the puller and (for adapter-only sync) the base weights adapters are merged into."""

    def __init__(self, store: str, sync_cfg: WeightSyncConfig, model_path: Path):
        self.puller = WeightPuller(store, sync_cfg)
        self.model_path = Path(model_path)
        self._base = None
        self.version = 0

    def update(self, engine, min_version: int, exact: bool = False) -> dict:
        """Pull the newest version >= ``min_version`` (``exact``: that version itself) and load it
        into ``engine`` (nothing moves when the engine already holds it)."""
        result = self.puller.pull(min_version, exact=exact)
        load_s = 0.0
        if result.stats.nbytes:
            started = time.perf_counter()
            tensors = result.tensors
            if is_adapter(tensors):
                if self._base is None:
                    # float32: a bf16 base would round W0 + scale * B @ A to bf16 before the engine
                    # sees it, losing small adapter updates even in a float32 engine; the engine
                    # casts to its own dtype on load
                    self._base = load_base_state(self.model_path, torch.float32)
                tensors = merge_adapter(self._base, tensors)
            engine.load_weights(tensors.items())
            load_s = time.perf_counter() - started
        self.version = result.version
        return {"version": result.version, "pull_s": result.stats.seconds,
                "transfer_s": result.stats.transfer_seconds, "bytes": result.stats.nbytes, "load_s": load_s,
                "transport": result.stats.transport}


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
