"""Runtime: everything a training run needs alive at once — the environment, the model on disk,
the renderer, the task, the actor meshes, their supervisor and the GRPO loop over them. Used by
`meshrl train` and by tests and scripts that compose the pieces themselves."""

from __future__ import annotations

import dataclasses
import logging
import time

from meshrl.config.run import RunConfig

log = logging.getLogger("meshrl")


class Runtime:
    """Spawns the meshes described by a RunConfig; `close()` (or `with`) stops them."""

    def __init__(self, cfg: RunConfig, hosts=None, actors: dict[str, type] | None = None):
        """``hosts`` (a `meshrl.meshes.hosts.Hosts`) come from a launcher; None = this machine for
        every host mesh. ``actors`` replaces the actor class of a standard mesh (e.g. a rewarder of
        your own with the Rewarder's endpoints)."""
        from meshrl.meshes.local import prepare_environment

        prepare_environment(cfg.meshes, cfg.launch)
        from transformers import AutoTokenizer

        from meshrl.actors.generator import POLICY_STORE, Generator
        from meshrl.actors.learner import Learner
        from meshrl.actors.rewarder import load_reward_fn
        from meshrl.channels.weight_store import silence_tcp_fallback_warning
        from meshrl.controller.faults import FaultInjector
        from meshrl.controller.grpo import GRPOLoop
        from meshrl.controller.mesh_client import ENV, GENERATOR, LEARNER, REWARDER, MeshClient
        from meshrl.controller.rollout import Counters, strategy_for
        from meshrl.controller.supervisor import Supervisor
        from meshrl.envs.task_sets import make_task
        from meshrl.meshes.group import MeshGroup
        from meshrl.meshes.hosts import Hosts
        from meshrl.meshes.placement import plan_run
        from meshrl.meshes.rendezvous import Rendezvous
        from meshrl.meshes.supervision import install_fault_hook
        from meshrl.models.provision import resolve_model
        from meshrl.renderers import renderer_for_tokenizer
        from meshrl.sdpo.channel import SDPO_TEACHER, SDPOChannel

        silence_tcp_fallback_warning()
        started = time.perf_counter()
        self.cfg = cfg
        if cfg.rewarder.reward_fn:
            load_reward_fn(cfg.rewarder.reward_fn)  # fail here, in one line, not inside an actor
        self.failures = install_fault_hook()
        self.model_path = resolve_model(cfg.model.name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.renderer = renderer_for_tokenizer(self.tokenizer)
        self.task = make_task(cfg.task, cfg.trainer.seed)
        strategy = strategy_for(self.task)
        self.hosts = hosts if hosts is not None else Hosts.local(cfg.launch)
        self.meshes = MeshGroup(cfg.meshes, self.hosts, plan_run(cfg), actors)
        try:
            path = str(self.model_path)
            # a generator in the learner's processes samples with (or copies from) its module in-process;
            # the weight store then serves only the SDPO teacher, if any
            shared = cfg.meshes.generator.colocate_with == LEARNER
            self.meshes.spawn(LEARNER, Learner, path, cfg.model, cfg.learner, cfg.weight_sync, POLICY_STORE,
                              Rendezvous(), share_in_process=shared, publish_to_store=not shared or cfg.sdpo.alpha > 0,
                              diloco_cfg=cfg.diloco)
            self.meshes.spawn(GENERATOR, Generator, path, cfg.model, cfg.generator, cfg.weight_sync, POLICY_STORE,
                              in_learner_process=shared)
            strategy.spawn(self.meshes, cfg)
            if cfg.sdpo.alpha > 0:
                SDPOChannel.spawn(self.meshes, cfg, path)
            self.infos = self.meshes.wait_ready()
        except BaseException:
            self.meshes.stop()
            raise
        log.info("meshes ready in %.1fs: %s", time.perf_counter() - started, self.meshes.pids)
        self.supervisor = Supervisor(self.meshes, cfg.faults)
        faults = FaultInjector(cfg.faults.inject, self.meshes) if cfg.faults.inject else None
        timeouts = {GENERATOR: cfg.generator.generate_timeout_s, LEARNER: cfg.learner.call_timeout_s,
                    REWARDER: cfg.rewarder.timeout_s, ENV: cfg.rewarder.timeout_s, SDPO_TEACHER: cfg.sdpo.call_timeout_s,
                    "sync": cfg.learner.call_timeout_s}
        self.client = MeshClient(self.meshes, self.supervisor, timeouts, cfg.meshes.chunks_per_replica, faults)
        counters = Counters()
        sdpo = SDPOChannel(cfg.sdpo, self.client, self.renderer) if cfg.sdpo.alpha > 0 else None
        self.replay = None
        if cfg.replay.beta > 0 and cfg.diloco.role == "learn":  # pairs come in the shards
            from meshrl.controller.shard_source import ShardPairs

            self.replay = ShardPairs(cfg.replay)
        elif cfg.replay.beta > 0:
            from meshrl.replay.channel import ReplayChannel

            try:
                self.replay = ReplayChannel(cfg.replay, self.client, self.renderer)
            except BaseException:
                self.meshes.stop()
                raise
        self.loop = None
        try:
            self.loop = GRPOLoop(cfg, self.task, strategy(self.client, self.renderer, cfg.model.max_model_len,
                                                          counters),
                                 self.client, counters, tuple(self.renderer.get_stop_sequences()), sdpo, self.replay)
            # a DiLoCo replica starts from the run's weights (its own become the run's if it is the first)
            self.loop.diloco_join()
        except BaseException:
            if self.loop is not None:
                self.loop.close()
            if self.replay is not None:
                self.replay.close()
            self.meshes.stop()
            raise
        # version 0 = the initial weights, published so that a replaced generator can always pull
        # the run's current version, even before the first update
        self.client.publish(0)

    def learner_call(self, endpoint: str, *args, timeout_s: float | None = None):
        """A call on every learner rank outside the loop's recovery (checkpoint save/load, export);
        rank 0's reply."""
        return self.client.on_learners(endpoint, *args, supervised=False, timeout_s=timeout_s)

    def restore_learner(self, checkpoint, respawn: bool = True) -> None:
        """Load ``checkpoint`` into the learner (None = start over from the initial weights), rejoin
        the DiLoCo run if there is one (meshrl.diloco.replica: the run's newest round), republish
        those weights and bring every reader to them. After a learner failure
        (``respawn``) its processes, and any mesh sharing them, are replaced first."""
        self.loop.stop_producer()  # nothing is generated while the learner's state is replaced
        replaced = [name for name in self.meshes.respawn("learner") if name != "learner"] if respawn else []
        if checkpoint is not None:
            self.learner_call("load_checkpoint", str(checkpoint.learner_dir))
            self.loop.load_state_dict(checkpoint.state["loop"])
        else:
            self.loop.load_state_dict({"version": 0, "step_index": 0,
                                       "counters": dataclasses.asdict(self.loop.counters)})
        self.loop.diloco_join()
        version = self.loop.version
        self.learner_call("publish", version)
        # every weight reader (replaced ones included: a generator in the learner's processes can
        # only follow the new learner) now holds the restored version; then the other replaced
        # meshes' own re-sync
        self.client.sync_readers(version)
        for name in replaced:
            if name not in self.client.readers and name in self.supervisor.resync:
                self.supervisor.resync[name]()

    def close(self) -> None:
        self.loop.close()
        if self.replay is not None:
            self.replay.close()
        self.meshes.stop()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
