"""A real learner mesh for benchmarks that drive the learner alone (no generator, no controller loop).

    with learner_mesh(cfg, learner_cfg, "bench-x", procs=1) as client:
        client.forward_backward(datums, "ppo"); client.optim_step(learner_cfg.adam_params())
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def learner_mesh(cfg, learner_cfg, name: str, procs: int = 1):
    """A MeshClient over ``procs`` Learner processes (Monarch, the run config's model) with
    ``learner_cfg``; the mesh is stopped on exit. The processes inherit this process's environment
    as it is when called."""
    from meshrl.actors.learner import Learner
    from meshrl.config.launch import LaunchConfig
    from meshrl.config.meshes import MeshesConfig
    from meshrl.meshes.client import MeshClient
    from meshrl.meshes.group import MeshGroup
    from meshrl.meshes.hosts import Hosts
    from meshrl.meshes.rendezvous import Rendezvous
    from meshrl.meshes.supervisor import Supervisor
    from meshrl.models.provision import resolve_model

    group = MeshGroup(MeshesConfig(learner={"procs": procs}), Hosts.local(LaunchConfig()))
    try:
        group.spawn("learner", Learner, str(resolve_model(cfg.model.name_or_path)), cfg.model, learner_cfg,
                    cfg.weight_sync, name, Rendezvous())
        group.wait_ready(timeout_s=600)
        yield MeshClient(group, Supervisor(group, cfg.faults), {"learner": 1800.0, "sync": 600.0},
                         cfg.meshes.chunks_per_replica)
    finally:
        group.stop()
