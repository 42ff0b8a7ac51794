"""MeshGroup: spawns one proc mesh per mesh name (or shares one when co-located) and the actor
meshes on them, waits for their setup with a deadline, and stops everything on exit."""

from __future__ import annotations

import logging
from typing import Any

from meshrl.config.meshes import MeshesConfig

log = logging.getLogger(__name__)


class MeshSpawnError(RuntimeError):
    """A mesh did not come up: the message names the mesh and the cause."""


class MeshGroup:
    """The run's proc meshes and actor meshes."""

    def __init__(self, cfg: MeshesConfig, host: Any):
        self.cfg = cfg
        self.host = host
        self.proc_meshes: dict[str, Any] = {}
        self.actor_meshes: dict[str, Any] = {}

    def _owner(self, name: str) -> str:
        return getattr(self.cfg, name).colocate_with or name

    def procs(self, name: str):
        """The proc mesh that actors of mesh ``name`` run on (spawned on first use)."""
        owner = self._owner(name)
        if owner not in self.proc_meshes:
            count = getattr(self.cfg, owner).procs
            self.proc_meshes[owner] = self.host.spawn_procs(per_host={"procs": count}, name=owner)
        return self.proc_meshes[owner]

    def spawn(self, name: str, actor_cls: type, *args, **kwargs):
        """Spawn actor mesh ``name`` (non-blocking; call `wait_ready` before use)."""
        mesh = self.procs(name).spawn(name, actor_cls, *args, **kwargs)
        self.actor_meshes[name] = mesh
        return mesh

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
                raise MeshSpawnError(f"mesh '{name}' failed during setup: {_first_line(e)}") from None
        return infos

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every proc mesh; a mesh that will not stop is logged and abandoned."""
        for name, pm in list(self.proc_meshes.items()):
            try:
                pm.stop().get(timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - shutdown is best effort
                log.warning("stopping mesh '%s' failed: %s", name, _first_line(e))
        self.proc_meshes.clear()
        self.actor_meshes.clear()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
