"""Runtime: everything a training run needs alive at once — the environment, the model on disk,
the renderer, the task, the actor meshes, their supervisor and the GRPO loop over them. Used by
`meshrl train` and by tests and scripts that compose the pieces themselves."""

from __future__ import annotations

import logging
import time

from meshrl.config.run import RunConfig

log = logging.getLogger("meshrl")


class Runtime:
    """Spawns the meshes described by a RunConfig; `close()` (or `with`) stops them."""

    def __init__(self, cfg: RunConfig):
        from meshrl.launch.local import prepare_environment

        prepare_environment(cfg.meshes)
        from transformers import AutoTokenizer

        from meshrl.actors.generator import Generator
        from meshrl.actors.learner import Learner
        from meshrl.actors.rewarder import Rewarder, load_reward_fn, make_task
        from meshrl.channels.weight_store import silence_tcp_fallback_warning
        from meshrl.controller.faults import FaultInjector
        from meshrl.controller.grpo import GRPOLoop
        from meshrl.controller.supervisor import Supervisor
        from meshrl.launch.local import local_host
        from meshrl.meshes.group import MeshGroup
        from meshrl.meshes.supervision import install_fault_hook
        from meshrl.models.provision import resolve_model
        from meshrl.renderers import renderer_for_tokenizer

        silence_tcp_fallback_warning()
        started = time.perf_counter()
        self.cfg = cfg
        if cfg.rewarder.reward_fn:
            load_reward_fn(cfg.rewarder.reward_fn)  # fail here, in one line, not inside an actor
        self.failures = install_fault_hook()
        self.model_path = resolve_model(cfg.model.name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.renderer = renderer_for_tokenizer(self.tokenizer)
        self.task = make_task(cfg.task)
        self.meshes = MeshGroup(cfg.meshes, local_host())
        try:
            path = str(self.model_path)
            self.meshes.spawn("learner", Learner, path, cfg.model, cfg.learner, cfg.weight_sync)
            self.meshes.spawn("generator", Generator, path, cfg.model, cfg.generator, cfg.weight_sync)
            if cfg.task.kind == "code":  # the env mesh (sandboxed episodes) takes the rewarder's place
                from meshrl.actors.env_actor import EnvActor
                from meshrl.controller.multiturn import ENV

                spec = cfg.meshes.rewarder
                self.meshes.add_mesh(ENV, spec.procs, spec.colocate_with)
                self.meshes.spawn(ENV, EnvActor, cfg.task.code.env)
            else:
                self.meshes.spawn("rewarder", Rewarder, cfg.task, cfg.rewarder)
            if cfg.sdpo.alpha > 0:
                from meshrl.actors.sdpo_teacher import SDPOTeacherActor
                from meshrl.controller.grpo import SDPO_TEACHER

                self.meshes.add_mesh(SDPO_TEACHER, cfg.sdpo.mesh.procs, cfg.sdpo.mesh.colocate_with)
                self.meshes.spawn(SDPO_TEACHER, SDPOTeacherActor, path, cfg.model, cfg.weight_sync,
                                  cfg.learner.torch_threads)
            self.infos = self.meshes.wait_ready()
        except BaseException:
            self.meshes.stop()
            raise
        log.info("meshes ready in %.1fs: %s", time.perf_counter() - started, self.meshes.pids)
        self.supervisor = Supervisor(self.meshes, cfg.faults)
        self.faults = FaultInjector(cfg.faults.inject, self.meshes) if cfg.faults.inject else None
        self.replay = None
        if cfg.replay.beta > 0:
            from meshrl.controller.replay_channel import ReplayChannel

            try:
                self.replay = ReplayChannel(cfg.replay, self.meshes, self.supervisor, self.renderer)
            except BaseException:
                self.meshes.stop()
                raise
        self.loop = GRPOLoop(cfg, self.task, self.renderer, self.meshes, self.supervisor, self.faults,
                             self.replay)
        # version 0 = the initial weights, published so that a replaced generator can always pull
        # the run's current version, even before the first update
        self.learner_call("publish", lambda m: m.publish.call_one(0))

    def learner_call(self, what: str, call, timeout_s: float | None = None):
        """A direct learner call outside the loop's recovery (checkpoint save/load, export)."""
        return call(self.meshes["learner"]).get(timeout=timeout_s or self.cfg.learner.call_timeout_s)

    def restore_learner(self, checkpoint, respawn: bool = True) -> None:
        """Load ``checkpoint`` into the learner (None = start over from the initial weights),
        republish those weights and bring every generator to them. After a learner failure
        (``respawn``) its processes, and any mesh sharing them, are replaced first."""
        if respawn:
            for name in self.meshes.respawn("learner"):
                if name != "learner" and name in self.supervisor.resync:
                    self.supervisor.resync[name]()
        if checkpoint is not None:
            self.learner_call("load_checkpoint", lambda m: m.load_checkpoint.call_one(str(checkpoint.learner_dir)))
            self.loop.load_state_dict(checkpoint.state["loop"])
        else:
            self.loop.load_state_dict({"cursor": 0, "version": 0, "step_index": 0,
                                       "counters": self.loop.state_dict()["counters"]})
        version = self.loop.version
        self.learner_call("publish", lambda m: m.publish.call_one(version))
        self.loop.sync_readers(version)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self.meshes.stop()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
