"""PolicyFollower: how a weight reader (generator, SDPO teacher) keeps its engine on the learner's
latest version — pull from the weight store, merge a LoRA adapter into the base weights when only
the adapter was published, load into the engine between requests."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from meshrl.config.channels import WeightSyncConfig
from meshrl.channels.weight_store import WeightPuller
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
