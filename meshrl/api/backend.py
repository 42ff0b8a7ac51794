"""The meshes behind the API: one learner process holding every training client's LoRA adapter on
one base model (peft adapters, each with its own AdamW state), and generator replicas that sample
from exactly the weight version a sampling client names.

Learner calls of different training clients interleave one call at a time; before each, the
client's adapter is made the active one (`use_adapter`). Every `save_weights_for_sampler` publishes
the adapter's merged weights as a new version of the weight store (version 0 = the base model);
a sampling request first brings every generator replica to its version (`load_version`, no transfer
when already held), and a generator that fails is replaced and brought back to that version by the
supervisor before the request is issued again."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from meshrl.api.errors import UserError
from meshrl.config.base import ConfigError
from meshrl.config.run import RunConfig
from meshrl.config.meshes import GENERATOR
from meshrl.meshes.ranks import actor_at

log = logging.getLogger("meshrl")


class MeshBackend:
    """The learner and generator meshes of ``cfg`` on a `MeshSession` (on ``hosts``; None = this
    machine), with what runs on them serialised; `close()` stops them."""

    def __init__(self, cfg: RunConfig, hosts=None):
        from meshrl.meshes.session import MeshSession

        if cfg.meshes.learner.procs != 1:
            raise ConfigError("meshes.learner.procs: the API trains its clients' adapters in one learner process")
        if not (cfg.learner.lora.enabled and cfg.learner.lora.sync == "adapter"):
            raise ConfigError("learner.lora: the API trains LoRA adapters and publishes them as adapters: set "
                             "learner.lora.enabled=true and learner.lora.sync=adapter (configs/serve.yaml does)")
        if cfg.meshes.generator.colocate_with is not None:
            raise ConfigError("meshes.generator.colocate_with: the API's generators sample exact weight versions "
                             "of many adapters, pulled from the weight store: give them processes of their own")
        self.cfg = cfg
        self.session = session = MeshSession(cfg, hosts)
        try:
            session.spawn_policy()
            session.wait_ready()
            self.client = session.client
            # a replaced generator comes back to the version being sampled, not the newest one
            session.supervisor.on_respawn(GENERATOR, lambda: self._load_on_generators(self._sampled_version))
            self._learner_lock = threading.Lock()
            self._generator_lock = threading.Lock()
            self._active: str | None = None
            self._next_version = 1
            self._sampled_version = 0
            self.client.publish(0)  # the base model (no adapter: the initial one's B is zero)
        except BaseException:
            session.close()
            raise

    @property
    def model_path(self):
        return self.session.model_path

    @property
    def tokenizer(self):
        return self.session.tokenizer

    # ---- the learner ------------------------------------------------------------------------
    def learner(self, adapter: str | None, endpoint: str, *args):
        """``endpoint(*args)`` on the learner with ``adapter`` active (None: whatever is active)."""
        with self._learner_lock:
            if adapter is not None and adapter != self._active:
                self._on_learner("use_adapter", adapter)
                self._active = adapter
            return self._on_learner(endpoint, *args)

    def _on_learner(self, endpoint: str, *args):
        return self.client.on_learners(endpoint, *args, supervised=False)

    def forget_adapter(self, adapter: str) -> None:
        """Drop ``adapter`` and its optimizer state from the learner (its training client closed);
        the config's own adapter (`default`) becomes the active one if it was."""
        with self._learner_lock:
            if self._active == adapter:
                self._on_learner("use_adapter", "default")
                self._active = "default"
            self._on_learner("remove_adapter", adapter)

    def publish(self, adapter: str) -> int:
        """Publish ``adapter``'s merged weights as a new version; returns it."""
        with self._learner_lock:
            version = self._next_version
            self._next_version += 1
        self.learner(adapter, "publish", version)
        return version

    # ---- the generators ---------------------------------------------------------------------
    def generate(self, version: int, prompts: list[list[int]], request) -> list:
        """Completions per prompt sampled with weight ``version`` on the generator replicas."""
        with self._generator_lock:
            self._sampled_version = version
            self._load_on_generators(version)
            return self.client.generate(prompts, request)

    def prompt_logprobs(self, version: int, sequences: list[list[int]]) -> list[list[float]]:
        """Per-token logprobs of ``sequences`` under weight ``version`` (a generator's `score`)."""
        with self._generator_lock:
            self._sampled_version = version
            self._load_on_generators(version)
            return self.client.supervised(GENERATOR, lambda: self.client.per_rank(
                GENERATOR, "score", {0: sequences})[0], "generator.score")

    def _load_on_generators(self, version: int) -> None:
        """Every generator replica holds ``version`` (replaced first if one has failed)."""
        self.client.supervised(GENERATOR, lambda: self._load(version), "generator.load_version")

    def _load(self, version: int) -> None:
        from monarch.actor import ActorError

        ranks = range(self.client.procs(GENERATOR))
        try:
            self.client.unsupervised(GENERATOR, lambda m: [actor_at(m, r).load_version.call_one(version) for r in ranks],
                                     "generator.load_version")
        except ActorError as e:
            if "not in the index" in str(e):  # reclaimed: the caller's matter, not a failed generator
                raise UserError(f"the sampler weights of version {version} are no longer kept "
                                f"(weight_sync.keep_versions = {self.cfg.weight_sync.keep_versions}): save them "
                                "again") from None
            raise

    def close(self) -> None:
        self.session.close()


def checkpoint_root(cfg: RunConfig) -> Path:
    """Where the API keeps its clients' checkpoints: `output.dir/output.name` (name default `api`)."""
    return Path(cfg.output.dir) / (cfg.output.name or "api")
