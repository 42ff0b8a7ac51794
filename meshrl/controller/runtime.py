"""Runtime: everything a training run needs alive at once, on one `MeshSession`: the task, the
meshes that score its rollouts, the loss terms and their meshes, the step hooks (DiLoCo) and the
GRPO loop over them. Used by `meshrl train` and by tests and scripts that compose the pieces
themselves."""

from __future__ import annotations

import logging

from meshrl.config.meshes import LEARNER
from meshrl.config.run import RunConfig

log = logging.getLogger("meshrl")


def assemble_loop(cfg: RunConfig, task, strategy, client, counters, renderer, parts: list | None = None):
    """The GRPO loop of ``cfg`` over ``client``'s meshes (their term meshes spawned and ready): its
    loss terms (meshrl.terms), its DiLoCo link as step hook and, for a learner of shards, as
    rollout source. ``parts`` collects what is built, so a failure midway can close it."""
    from meshrl.controller.diloco_link import DiLoCoLink
    from meshrl.controller.grpo import GRPOLoop
    from meshrl.terms import TermContext, build_terms

    parts = [] if parts is None else parts
    link = DiLoCoLink(cfg, client)
    parts.append(link)
    terms = build_terms(TermContext(cfg, client, renderer))
    parts += terms
    return GRPOLoop(cfg, task, strategy, client, counters, tuple(renderer.get_stop_sequences()), terms,
                    link.rollouts(counters), (link,))


class Runtime:
    """The run of ``cfg`` on a `MeshSession`; `close()` (or `with`) stops it."""

    def __init__(self, cfg: RunConfig, hosts=None, actors: dict[str, type] | None = None, session=None):
        """``hosts`` (a `meshrl.meshes.hosts.Hosts`) come from a launcher; None = this machine for
        every host mesh. ``actors`` replaces the actor class of a standard mesh (e.g. a rewarder of
        your own with the Rewarder's endpoints). ``session``: run in the processes of this
        `MeshSession` (`begin_run`: fresh actors; its processes stay when the run is closed)
        instead of a session of the run's own."""
        from meshrl.actors.rewarder import load_reward_fn
        from meshrl.controller.rollout import Counters, strategy_for
        from meshrl.envs.task_sets import make_task
        from meshrl.meshes.placement import resolve_run
        from meshrl.meshes.session import host_run
        from meshrl.terms import check_config, term_classes

        cfg = resolve_run(cfg).cfg  # the loop sees the layout the session spawns (e.g. co-location)
        check_config(cfg)  # the plugins, the loss and the terms, before anything is spawned
        if cfg.rewarder.reward_fn:
            load_reward_fn(cfg.rewarder.reward_fn)  # fail here, in one line, not inside an actor
        self.cfg = cfg
        self.task = make_task(cfg.task, cfg.trainer.seed)
        session, self._release = host_run(cfg, session, hosts, actors)
        self.session = session
        self.loop = None
        try:
            strategy = strategy_for(self.task)
            terms = term_classes(cfg)
            session.spawn_policy(store_readers=any(t.reads_weights(cfg) for t in terms))
            strategy.spawn(session, cfg)
            for term in terms:
                term.spawn(session, cfg)
            self.infos = session.wait_ready()
            self.counters = Counters()
            parts = []  # closed with the session: by the loop once it exists (it closes what it was given)
            session.on_close(lambda: self.loop.close() if self.loop is not None else [p.close() for p in parts])
            rollouts = strategy(session.client, session.renderer, cfg.model.max_model_len, self.counters)
            self.loop = assemble_loop(cfg, self.task, rollouts, session.client, self.counters, session.renderer,
                                      parts)
            self.loop.join()  # e.g. a DiLoCo replica starts from the run's weights
            # version 0 = the initial weights, published so that a replaced generator can always
            # pull the run's current version, even before the first update
            session.client.publish(0)
        except BaseException:
            self.close()
            raise

    @property
    def meshes(self):
        return self.session.meshes

    @property
    def client(self):
        return self.session.client

    @property
    def supervisor(self):
        return self.session.supervisor

    @property
    def hosts(self):
        return self.session.hosts

    @property
    def renderer(self):
        return self.session.renderer

    def learner_call(self, endpoint: str, *args, timeout_s: float | None = None):
        """A call on every learner rank outside the loop's recovery (checkpoint save/load, export);
        rank 0's reply."""
        return self.client.on_learners(endpoint, *args, supervised=False, timeout_s=timeout_s)

    def restore_learner(self, checkpoint, respawn: bool = True) -> None:
        """Load ``checkpoint`` into the learner (None = start over from the initial weights), bring
        it to the step hooks' state (a DiLoCo run's newest round), republish those weights and
        bring every reader to them. After a learner failure (``respawn``) its processes, and any
        mesh sharing them, are replaced first."""
        self.loop.stop_producer()  # nothing is generated while the learner's state is replaced
        replaced = [name for name in self.meshes.respawn(LEARNER) if name != LEARNER] if respawn else []
        if checkpoint is not None:
            self.learner_call("load_checkpoint", str(checkpoint.learner_dir))
            self.loop.load_state_dict(checkpoint.state["loop"])
        else:
            self.loop.load_state_dict(self.loop.start_over_state())
        self.loop.join()
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
        """Stop the run: its loop, terms and hooks, then the session's meshes (a session of the run's
        own) or only the run's actors (a session given to it)."""
        self._release()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
