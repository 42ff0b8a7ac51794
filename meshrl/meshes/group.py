"""MeshGroup: spawns one proc mesh per mesh name (or shares one when co-located), each process
seeing only the GPUs its placement gives it, and the actor meshes on them; waits for their setup
with a deadline, replaces a damaged proc mesh (on the same GPUs) together with every actor mesh on
it, and stops everything on exit."""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

import psutil

from meshrl.config.meshes import MeshesConfig, MeshSpec
from meshrl.meshes.placement import Placement

log = logging.getLogger(__name__)


class MeshSpawnError(RuntimeError):
    """A mesh did not come up: the message names the mesh and the cause."""


@dataclass
class _ActorSpec:
    owner: str
    actor_cls: type
    args: tuple
    kwargs: dict = field(default_factory=dict)


class MeshGroup:
    """The run's proc meshes and actor meshes, by name. With a ``placement`` every proc mesh is
    spawned with its bootstrap (CUDA_VISIBLE_DEVICES per process); without one, processes inherit
    the controller's CUDA environment."""

    def __init__(self, cfg: MeshesConfig, host: Any, placement: Placement | None = None):
        self.cfg = cfg
        self.host = host
        self.placement = placement
        self.proc_meshes: dict[str, Any] = {}
        self.actor_meshes: dict[str, Any] = {}
        self.pids: dict[str, list[int]] = {}
        self.infos: dict[str, list[dict]] = {}
        self._specs: dict[str, _ActorSpec] = {}
        self._extra_meshes: dict[str, MeshSpec] = {}
        self._stopping: list[tuple[str, Any]] = []  # (name, stop future) of replaced proc meshes
        self.generation: dict[str, int] = {}

    def procs_of(self, name: str) -> int:
        """Number of processes (= actors) of mesh ``name``."""
        return self._mesh_spec(self._owner(name)).procs

    def _mesh_spec(self, name: str) -> MeshSpec:
        if name in self._extra_meshes:
            return self._extra_meshes[name]
        return getattr(self.cfg, name)

    def add_mesh(self, name: str, procs: int, colocate_with: str | None = None) -> None:
        """Declare a mesh that is not part of MeshesConfig (e.g. an optional channel's actors)."""
        self._extra_meshes[name] = MeshSpec(procs=procs, colocate_with=colocate_with)

    def _owner(self, name: str) -> str:
        return self._mesh_spec(name).colocate_with or name

    def _procs(self, owner: str):
        if owner not in self.proc_meshes:
            count = self._mesh_spec(owner).procs
            self.generation[owner] = self.generation.get(owner, -1) + 1
            bootstrap = self.placement.bootstrap(owner, count) if self.placement is not None else None
            self.proc_meshes[owner] = self.host.spawn_procs(
                per_host={"procs": count}, name=f"{owner}-g{self.generation[owner]}", bootstrap=bootstrap
            )
        return self.proc_meshes[owner]

    def spawn(self, name: str, actor_cls: type, *args, **kwargs):
        """Spawn actor mesh ``name`` (non-blocking; call `wait_ready` before use)."""
        spec = _ActorSpec(self._owner(name), actor_cls, args, kwargs)
        self._specs[name] = spec
        mesh = self._procs(spec.owner).spawn(name, actor_cls, *args, **kwargs)
        self.actor_meshes[name] = mesh
        return mesh

    def __getitem__(self, name: str):
        return self.actor_meshes[name]

    def wait_ready(self, names: list[str] | None = None, timeout_s: float | None = None) -> dict[str, list]:
        """Call every actor's `info` endpoint (which runs after its setup) and wait with a deadline."""
        timeout_s = timeout_s or self.cfg.spawn_timeout_s
        futures = {n: self.actor_meshes[n].info.call() for n in (names or list(self.actor_meshes))}
        infos = {}
        for name, fut in futures.items():
            try:
                infos[name] = list(fut.get(timeout=timeout_s).values())
            except TimeoutError:
                raise MeshSpawnError(f"mesh '{name}' was not ready after {timeout_s:g}s (meshes.spawn_timeout_s)") from None
            except Exception as e:  # ActorError / SupervisionError from a failed setup
                raise MeshSpawnError(f"mesh '{name}' failed during setup: {first_line(e)}") from None
            here = socket.gethostname()
            # only processes on this host can be watched and killed; a pid elsewhere means nothing here
            self.pids[name] = [int(i["pid"]) for i in infos[name] if i.get("host", here) == here]
            self.infos[name] = infos[name]
        return infos

    def cohabitants(self, name: str) -> list[str]:
        """Every actor mesh sharing ``name``'s processes (including itself)."""
        owner = self._owner(name)
        return [n for n, spec in self._specs.items() if spec.owner == owner]

    def respawn(self, name: str) -> list[str]:
        """Replace the proc mesh under ``name`` and re-create every actor mesh that lived on it.
        Returns the names of the re-created actor meshes (already ready)."""
        owner = self._owner(name)
        names = self.cohabitants(name)
        old = self.proc_meshes.pop(owner, None)
        if old is not None:
            # a hung process would hold its memory and cores while the replacement starts
            for n in names:
                for pid in self.pids.pop(n, []):
                    _kill_tree(pid)
            # stop the damaged mesh in the background: the replacement need not wait for it
            self._stopping.append((owner, old.stop()))
        for n in names:
            spec = self._specs[n]
            self.actor_meshes[n] = self._procs(owner).spawn(n, spec.actor_cls, *spec.args, **spec.kwargs)
        self.wait_ready(names)
        return names

    def dead_process(self, name: str) -> str | None:
        """A one-line reason if a process of mesh ``name`` (or of the mesh whose processes it
        shares) has exited; None while all are alive. Local processes only."""
        for mesh in self.cohabitants(name):
            for pid in self.pids.get(mesh, []):
                try:
                    status = psutil.Process(pid).status()
                except psutil.NoSuchProcess:
                    return f"process {pid} of mesh '{mesh}' is gone"
                if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    return f"process {pid} of mesh '{mesh}' died"
        return None

    def kill(self, name: str, rank: int = 0, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the process of actor ``rank`` of mesh ``name`` (fault injection)."""
        pid = self.pids[name][rank]
        os.kill(pid, sig)
        return pid

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every proc mesh (and finish stopping replaced ones); a mesh that will not stop is
        logged and abandoned (a lost host cannot be stopped)."""
        futures = [(name, pm.stop()) for name, pm in self.proc_meshes.items()] + self._stopping
        for name, fut in futures:
            try:
                fut.get(timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - shutdown is best effort
                log.warning("stopping mesh '%s' failed: %s", name, first_line(e))
        self._stopping.clear()
        self.proc_meshes.clear()
        self.actor_meshes.clear()


def _kill_tree(pid: int) -> None:
    """SIGKILL a process this controller started (directly or not) and its descendants, if still
    alive; a pid that now belongs to some other process is left alone."""
    try:
        proc = psutil.Process(pid)
        if os.getpid() not in {p.pid for p in proc.parents()}:
            return
        family = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's text (Monarch errors carry long reports)."""
    for line in str(error).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__
