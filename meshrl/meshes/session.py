"""MeshSession: the one bring-up of a run's meshes, under every front end (`meshrl train`, the
Tinker-style API and `meshrl serve`, `meshrl.launch.compose.Cluster`).

A session prepares the process-wide environment, routes Monarch's unhandled faults to a log,
resolves the model and its tokenizer, and owns the run's `MeshGroup`, `Supervisor` (with fault
injection when `faults.inject` asks for it) and `MeshClient`. Meshes are spawned without waiting
(`spawn_policy` for the learner and generators, `spawn` for any other), so they start together;
`wait_ready` then waits for all of them. `close()` (or leaving a `with` block) runs what was
registered with `on_close`, newest first, then stops every mesh; a failure anywhere in a front end's
bring-up must end in `close()`, so nothing is left running however the bring-up ends.

A session can host one run after another (`begin_run` ... `end_run`): each run spawns fresh actors
(fresh weights, optimizer, engines, supervision and fault injection) in the processes the session
already has, which spares a process start and its imports per mesh (a notebook trying configs, a
test suite). The runs must agree on what decides the processes (`meshes`, `launch`) and on the
model (`model.name_or_path`: the session's tokenizer).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from meshrl.config.meshes import ENV, GENERATOR, LEARNER, REWARDER, MESH_NAMES
from meshrl.config.run import RunConfig
from meshrl.judges.judge import LOOP_GRACE_S
from meshrl.meshes.client import MeshClient
from meshrl.meshes.group import MeshDecl, MeshGroup
from meshrl.meshes.local import prepare_environment

log = logging.getLogger("meshrl")


def call_timeouts(cfg: RunConfig) -> dict[str, float]:
    """The deadline of one call on each standard mesh, and `sync` for weight pulls. An env mesh
    whose episodes are judged gets the judge's deadline on top (its `finish` waits for judgments)."""
    judge = cfg.task.env.judge if cfg.task.kind == "env" and cfg.task.env is not None else None
    env_s = cfg.rewarder.timeout_s + (judge.deadline_s + LOOP_GRACE_S if judge is not None else 0.0)
    return {GENERATOR: cfg.generator.generate_timeout_s, LEARNER: cfg.learner.call_timeout_s,
            REWARDER: cfg.rewarder.timeout_s, ENV: env_s, "sync": cfg.learner.call_timeout_s}


class MeshSession:
    """The meshes of ``cfg`` on ``hosts`` (a launcher's `meshrl.meshes.hosts.Hosts`; None = this
    machine for every host mesh). ``actors`` replaces the actor class of a mesh by name (e.g. a
    rewarder of your own with the Rewarder's endpoints); ``placement`` replaces the GPU placement
    of ``cfg``'s meshes (`plan_run`), e.g. an empty one for meshes of your own only."""

    def __init__(self, cfg: RunConfig, hosts=None, actors: dict[str, type] | None = None, placement=None):
        from meshrl.meshes.hosts import Hosts
        from meshrl.meshes.placement import plan_run, resolve_run

        cfg = resolve_run(cfg).cfg  # `gpus_per_proc: auto` decided once, for the processes and their GPUs
        prepare_environment(cfg.meshes, cfg.launch)
        from meshrl.meshes.supervision import install_fault_hook
        from meshrl.transport.weight_store import silence_tcp_fallback_warning

        silence_tcp_fallback_warning()
        self.started = time.perf_counter()
        self.failures = install_fault_hook()
        self._closers: list[Callable[[], Any]] = []
        self._model_path = None
        self._tokenizer = None
        self._renderer = None
        self.hosts = hosts if hosts is not None else Hosts.local(cfg.launch)
        self._placement = placement  # None: each run's meshes are placed from its config
        self.meshes = MeshGroup(cfg.meshes, self.hosts, placement if placement is not None else plan_run(cfg), actors)
        self._supervise(cfg)

    def _supervise(self, cfg: RunConfig) -> None:
        """A run's own supervision, fault injection and mesh client."""
        from meshrl.meshes.faults import FaultInjector
        from meshrl.meshes.supervisor import Supervisor

        self.cfg = cfg
        self.supervisor = Supervisor(self.meshes, cfg.faults)
        self.faults = FaultInjector(cfg.faults.inject, self.meshes) if cfg.faults.inject else None
        self.client = MeshClient(self.meshes, self.supervisor, call_timeouts(cfg), cfg.meshes.chunks_per_replica,
                                 self.faults)

    # ---- one run after another ----------------------------------------------------------------
    def begin_run(self, cfg: RunConfig, actors: dict[str, type] | None = None) -> None:
        """Host the run of ``cfg`` next (the previous run's actors are stopped first); its actors
        are spawned in the processes already here. ValueError names a section that decides the
        processes and differs from the session's."""
        from meshrl.meshes.placement import plan_run, resolve_run

        cfg = resolve_run(cfg).cfg
        for key in ("meshes", "launch"):
            if getattr(cfg, key) != getattr(self.cfg, key):
                raise ValueError(f"{key}: this session's processes were made for another `{key}` section; "
                                 "start a new MeshSession for this run")
        if cfg.model.name_or_path != self.cfg.model.name_or_path:
            raise ValueError(f"model.name_or_path = {cfg.model.name_or_path!r}: this session serves "
                             f"{self.cfg.model.name_or_path!r} (its tokenizer); start a new MeshSession for this run")
        self.end_run()
        self.started = time.perf_counter()
        self.meshes.overrides = dict(actors or {})
        self.meshes.placement = self._placement if self._placement is not None else plan_run(cfg)
        self._supervise(cfg)

    def end_run(self) -> None:
        """Run the `on_close` callbacks, then stop the run's actors; the processes stay."""
        try:
            self._run_closers()
        finally:
            self.meshes.stop_actors()

    # ---- the model ----------------------------------------------------------------------------
    @property
    def model_path(self):
        """The model's local directory (`model.name_or_path`, prepared if it is a packaged one)."""
        if self._model_path is None:
            from meshrl.models.provision import resolve_model

            self._model_path = resolve_model(self.cfg.model.name_or_path)
        return self._model_path

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    @property
    def renderer(self):
        """The chat template's renderer for the model's tokenizer (token in, token out)."""
        if self._renderer is None:
            from meshrl.renderers import renderer_for_tokenizer

            self._renderer = renderer_for_tokenizer(self.tokenizer)
        return self._renderer

    # ---- spawning -----------------------------------------------------------------------------
    def spawn_policy(self, store_readers: bool = False) -> None:
        """The learner and generator meshes (not waited for). ``store_readers``: meshes other than
        the generators pull the published weights (e.g. SDPO's teacher), so the learner publishes
        to the weight store even when the generators share its processes."""
        from meshrl.actors.generator import POLICY_STORE, Generator
        from meshrl.actors.learner import Learner
        from meshrl.meshes.rendezvous import Rendezvous

        cfg, path = self.cfg, str(self.model_path)
        # a generator in the learner's processes samples with (or copies from) its module in-process
        shared = cfg.meshes.generator.colocate_with == LEARNER
        self.meshes.spawn(LEARNER, Learner, path, cfg.model, cfg.learner, cfg.weight_sync, POLICY_STORE, Rendezvous(),
                          share_in_process=shared, publish_to_store=not shared or store_readers,
                          diloco_cfg=cfg.diloco, plugins=list(cfg.plugins))
        self.meshes.spawn(GENERATOR, Generator, path, cfg.model, cfg.generator, cfg.weight_sync, POLICY_STORE,
                          in_learner_process=shared, lora_modules=tuple(cfg.learner.lora.target_modules))

    def spawn(self, name: str, actor_cls: type, *args, procs: int | None = None, colocate_with: str | None = None,
              timeout_s: float | None = None, **kwargs):
        """Actor mesh ``name`` of ``actor_cls(*args, **kwargs)`` (not waited for): a standard mesh
        takes its placement from `meshes.<name>`, any other gets ``procs`` processes of its own or
        shares ``colocate_with``'s; ``timeout_s`` is the deadline of one call on it."""
        if name not in MESH_NAMES:
            self.meshes.add_mesh(name, procs or 1, colocate_with)
        if timeout_s is not None:
            self.client.timeouts[name] = timeout_s
        return self.meshes.spawn(name, actor_cls, *args, **kwargs)

    def declare(self, decl: MeshDecl, timeout_s: float | None = None):
        """A mesh of your own actors (`MeshDecl`: processes, host mesh, GPUs, environment), waited
        for (``timeout_s``, default `meshes.spawn_timeout_s`); returns the Monarch actor mesh."""
        self.meshes.declare(decl)
        self.meshes.wait_ready([decl.name], timeout_s)
        return self.meshes[decl.name]

    def wait_ready(self, names: list[str] | None = None) -> dict[str, list]:
        """Wait (with `meshes.spawn_timeout_s`) until every actor of ``names`` (all meshes) has
        finished its setup; their `info` replies."""
        infos = self.meshes.wait_ready(names)
        log.info("meshes ready in %.1fs: %s", time.perf_counter() - self.started, self.meshes.pids)
        return infos

    # ---- shutdown -----------------------------------------------------------------------------
    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` when the session closes (before the meshes stop; newest first)."""
        self._closers.append(fn)

    def _run_closers(self) -> None:
        """The `on_close` callbacks, newest first, each even if another fails."""
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the rest must close, and the meshes stop, all the same
                log.warning("closing: %s failed: %s", getattr(fn, "__qualname__", fn), e)

    def close(self) -> None:
        """Run the `on_close` callbacks, then stop every mesh."""
        try:
            self._run_closers()
        finally:
            self.meshes.stop()

    def __enter__(self) -> "MeshSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def host_run(cfg: RunConfig, session: MeshSession | None = None, hosts=None,
             actors: dict[str, type] | None = None) -> tuple[MeshSession, Callable[[], None]]:
    """The session that hosts the run of ``cfg``, and how to let go of it when the run ends:
    ``session``'s processes (`begin_run`; letting go stops only the run's actors) or a new
    `MeshSession` of the run's own (letting go stops its meshes)."""
    if session is None:
        session = MeshSession(cfg, hosts, actors)
        return session, session.close
    session.begin_run(cfg, actors)
    return session, session.end_run
