"""The meshes behind the API: one learner process holding every training client's LoRA adapter on
one base model (peft adapters, each with its own AdamW state), and generator replicas that sample
from exactly the weight version a sampling client names, each request on its own (the engine
batches requests continuously).

Learner calls of different training clients go through a `TenantLearner`
(meshrl.api.tenant_learner): one call at a time, each client's adapter made active first, and a
learner whose process dies replaced with every tenant brought back to where its last completed
call left it. Every `save_weights_for_sampler` publishes the adapter's merged weights as a new
version of the weight store (version 0 = the base model); the sampler brings every generator
replica to a request's version (`hold`: `load_version`, no transfer when already held) between
requests, or with `generator.lora_slots` each request names its version and the generators apply
that version's adapter to it beside the others (no weight load between versions; a replica pulls
an adapter the first time it is named), and a generator that fails is replaced and brought back to
the version held by the supervisor;
the requests that were running on it fail with the cause and are not issued again (one of them may
be what broke it), while a request the generator refuses alone fails as the caller's error."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from meshrl.api.errors import UserError
from meshrl.api.journal import LearnerJournal
from meshrl.api.tenant_learner import TenantLearner
from meshrl.config.base import ConfigError
from meshrl.config.run import RunConfig
from meshrl.config.meshes import GENERATOR, LEARNER
from meshrl.engines import PromptScoring, SampleRequest, Sampled
from meshrl.meshes.client import RequestFailed
from meshrl.meshes.ranks import actor_at

log = logging.getLogger("meshrl")

RECOVERY = ".recovery"
"""The folder of the checkpoint root that holds the tenants' snapshots."""


class MeshBackend:
    """The learner and generator meshes of ``cfg`` on a `MeshSession` (on ``hosts``; None = this
    machine), with what runs on them serialised; `close()` stops them."""

    def __init__(self, cfg: RunConfig, hosts=None):
        from meshrl.meshes.placement import resolve_run
        from meshrl.meshes.session import MeshSession

        cfg = resolve_run(cfg, colocate=False).cfg

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
            # a replaced generator comes back to the version being sampled, not the newest one; with
            # versions side by side it keeps the base weights it starts with (a merged version under
            # the adapters would apply one twice) and pulls each adapter when a request names it
            session.supervisor.on_respawn(GENERATOR, (lambda: None) if self.mixes_versions else
                                          (lambda: self._load_on_generators(self._sampled_version)))
            self._generator_lock = threading.Lock()
            self._sampled_version = 0
            journal = LearnerJournal(checkpoint_root(cfg) / RECOVERY, cfg.weight_sync.keep_versions)
            shutil.rmtree(journal.root, ignore_errors=True)  # an earlier server's tenants are gone
            # a replaced learner gets the published versions and the tenants back (sampling waits)
            self.tenants = TenantLearner(self.client, session.supervisor, journal, self._generator_lock,
                                         lambda: session.meshes.pids.get(LEARNER))
            self.client.publish(0)  # the base model (no adapter: the initial one's B is zero)
            journal.published(0, None)
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
        return self.tenants.call(adapter, endpoint, args)

    def forget_adapter(self, adapter: str) -> None:
        """Drop ``adapter`` and its optimizer state from the learner (its training client closed)."""
        self.tenants.forget(adapter)

    def publish(self, adapter: str, source: Path) -> int:
        """Publish ``adapter``'s merged weights as a new version (``source``: the sampler checkpoint
        just saved from them); returns it."""
        return self.tenants.publish(adapter, source)

    # ---- the generators ----------------------------------------------------------------------
    def hold(self, version: int) -> None:
        """Every generator replica holds weight ``version`` (and a replaced one comes back to it).
        The caller switches versions only while no request runs on the generators (the engine
        would otherwise pause new requests and let the running ones finish first)."""
        with self._generator_lock:
            self._sampled_version = version
            self._load_on_generators(version)

    @property
    def mixes_versions(self) -> bool:
        """Whether the generators sample any weight version beside others (`generator.lora_slots`:
        each version is an adapter the engine applies per request), so none is ever `hold`-ed."""
        return self.cfg.generator.lora_slots > 0

    def sample(self, prompt: list[int], request: SampleRequest, scoring: PromptScoring, version: int) -> Sampled:
        """One prompt sampled (and scored) on a generator replica under weight ``version`` (the
        version they hold, or with `mixes_versions` its adapter): it runs in the engine beside the
        other requests in flight (continuous batching). An exception the generator raises for this
        request alone is a UserError; one whose generator died under it fails too
        (`RequestLost`), after the generator is replaced."""
        try:
            return self.client.sample(prompt, request, scoring, version if self.mixes_versions else None)
        except RequestFailed as e:  # this request's own fault: the generator serves on
            if "not in the index" in str(e):
                raise self._gone(version) from None
            raise UserError(f"the generator refused this request: {e}") from None

    def _gone(self, version: int) -> UserError:
        return UserError(f"the sampler weights of version {version} are no longer kept "
                         f"(weight_sync.keep_versions = {self.cfg.weight_sync.keep_versions}): save them again")

    def _load_on_generators(self, version: int) -> None:
        """Every generator replica holds ``version`` (replaced first if one has failed)."""
        self.client.supervised(GENERATOR, lambda: self._load(version), "generator.load_version")

    def _load(self, version: int) -> None:
        from monarch.actor import ActorError

        ranks = range(self.client.procs(GENERATOR))
        try:
            started = time.perf_counter()
            stats = self.client.unsupervised(
                GENERATOR, lambda m: [actor_at(m, r).load_version.call_one(version) for r in ranks],
                "generator.load_version")
            log.info("generators hold weight version %d after %.2f s (per replica: pull %s s, load %s s)", version,
                     time.perf_counter() - started, "/".join(f"{s['pull_s']:.2f}" for s in stats),
                     "/".join(f"{s['load_s']:.2f}" for s in stats))
        except ActorError as e:
            if "not in the index" in str(e):  # reclaimed: the caller's matter, not a failed generator
                raise self._gone(version) from None
            raise

    def close(self) -> None:
        self.session.close()


def checkpoint_root(cfg: RunConfig) -> Path:
    """Where the API keeps its clients' checkpoints: `output.dir/output.name` (name default `api`)."""
    return Path(cfg.output.dir) / (cfg.output.name or "api")
