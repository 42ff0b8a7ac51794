"""SDPOTeacherActor: the current policy, re-run without grad on the student's context with a hint
inserted at the error turn; returns its top-k next-token log-probabilities on the student's own
response tokens (channel 2). Its weights follow the learner through the weight store, like a
generator's."""

from __future__ import annotations

import time
from pathlib import Path

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.actors.generator import POLICY_STORE
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.actors.follower import PolicyFollower, require_complete
from meshrl.transport.weight_store import silence_tcp_fallback_warning
from meshrl.config.generation import GeneratorConfig
from meshrl.config.model import ModelConfig
from meshrl.engines.hf_engine import HFEngine


class SDPOTeacherActor(MeshrlActor):
    """Scores error sites under the hinted context with the current policy weights."""

    def __init__(self, model_path: str, model_cfg: ModelConfig, sync_cfg: WeightSyncConfig,
                 torch_threads: int = 2, store: str = POLICY_STORE):
        silence_tcp_fallback_warning()
        engine_cfg = GeneratorConfig(backend="hf", torch_threads=torch_threads)
        self.engine = HFEngine(Path(model_path), engine_cfg, model_cfg.dtype, model_cfg.max_model_len, seed=0)
        self.follower = PolicyFollower(store, sync_cfg, Path(model_path))
        self.version = 0

    def describe(self) -> dict:
        return {"version": self.version}

    @endpoint
    def update_weights(self, min_version: int) -> dict:
        stats = self.follower.update(self.engine, min_version)
        self.version = self.follower.version
        return stats

    @endpoint
    def score_sites(self, sites: list[tuple[list[int], int, int]], top_k: int, min_prefix: int = 0) -> dict:
        """``sites`` = [(teacher_tokens, start, length)]; returns per site (top-k indices, their
        log-probs, the site tokens' log-probs), shared prefixes of ``min_prefix`` tokens or more
        forwarded once."""
        self.fault_point("score_sites")
        require_complete(self.follower)
        started = time.perf_counter()
        scored = self.engine.topk_logprobs([s[0] for s in sites], [s[1] for s in sites],
                                           [s[2] for s in sites], top_k, min_prefix)
        return {"topk": scored, "version": self.version, "seconds": time.perf_counter() - started}
