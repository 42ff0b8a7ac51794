"""Composing meshes yourself, on any launcher: `Cluster` starts the job a `launch:` section
describes and gives you its hosts to spawn your own actor meshes on (`MeshDecl`), to run the
standard training loop with actor classes of your own (`train`, `runtime`), or both.

    from meshrl.launch.compose import Cluster, MeshDecl

    with Cluster(cfg.launch, run_id="my-run") as cluster:
        judges = cluster.spawn(MeshDecl("judge", MyJudge, args=(...,), procs=2))
        result = cluster.train(cfg, run_dir, actors={"rewarder": MyRewarder})

Everything spawned is stopped and the job killed when the `with` block ends, however it ends.
"""

from __future__ import annotations

from pathlib import Path

from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import MeshesConfig
from meshrl.config.run import RunConfig
from meshrl.meshes.group import MeshDecl
from meshrl.meshes.local import prepare_environment
from meshrl.meshes.placement import Placement, gpus_for

__all__ = ["Cluster", "MeshDecl"]


class Cluster:
    """The hosts of one job (`launch`: which launcher, which host meshes) and the meshes you
    spawn on them, on a `MeshSession` of their own. ``meshes`` sets the spawn deadline and
    supervision timing of your meshes."""

    def __init__(self, launch: LaunchConfig, run_id: str = "compose", run_dir: Path | None = None,
                 meshes: MeshesConfig | None = None):
        self.launch = launch
        self.run_id = run_id
        self.run_dir = run_dir
        self.meshes_cfg = meshes or MeshesConfig()
        self.hosts = None
        self._launcher = None
        self._session = None
        self._runtimes: list = []

    def __enter__(self) -> "Cluster":
        prepare_environment(self.meshes_cfg, self.launch)
        from meshrl.launch import make_launcher
        from meshrl.meshes.session import MeshSession

        self._launcher = make_launcher(self.launch, self.run_id, self.run_dir)
        try:
            self.hosts = self._launcher.start()
            self._session = MeshSession(RunConfig(launch=self.launch, meshes=self.meshes_cfg), self.hosts,
                                        placement=Placement(gpus_for(self.launch), ()))
        except BaseException:
            self._launcher.stop()
            raise
        return self

    def spawn(self, decl: MeshDecl, timeout_s: float | None = None):
        """Spawn ``decl``'s actor mesh and wait until every actor has finished its `__init__`;
        returns the Monarch actor mesh."""
        self._require_started()
        return self._session.declare(decl, timeout_s)

    def runtime(self, cfg: RunConfig, actors: dict[str, type] | None = None):
        """The standard meshes of ``cfg`` on this cluster's hosts (`meshrl.controller.runtime.Runtime`),
        with the actor classes in ``actors`` (e.g. ``{"rewarder": MyRewarder}``) instead of the
        standard ones; closed with the cluster."""
        self._require_started()
        from meshrl.controller.runtime import Runtime

        rt = Runtime(cfg, self.hosts, actors)
        self._runtimes.append(rt)
        return rt

    def train(self, cfg: RunConfig, run_dir: Path, actors: dict[str, type] | None = None,
              resume: bool = False) -> dict:
        """The standard training run (checkpoints, evals, metrics in ``run_dir``) on this cluster's
        hosts, with the actor classes in ``actors``; returns its summary."""
        self._require_started()
        from meshrl.controller.train import run_training

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return run_training(cfg, Path(run_dir), resume=resume, hosts=self.hosts, actors=actors)

    def _require_started(self) -> None:
        if self._session is None:
            raise RuntimeError("use the Cluster in a `with` block: its job is started on entering it")

    def __exit__(self, *exc) -> None:
        try:
            for rt in self._runtimes:
                rt.close()
            if self._session is not None:
                self._session.close()
        finally:
            self._runtimes.clear()
            self._session = None
            if self._launcher is not None:
                self._launcher.stop()

