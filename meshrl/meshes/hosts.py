"""The run's hosts: host meshes by name (from whichever launcher provided them), which actor mesh
runs on which, and which hosts have been lost.

Every launcher (this machine, local host workers, SLURM, Kubernetes) yields Monarch HostMeshes;
`Hosts` is all the rest of the runtime sees of them. A lost host (its worker process gone, found by
the launcher's probe) is left out of every later spawn on its host mesh, so a replaced mesh comes
back on the surviving hosts, or the run stops naming the host when `launch.on_host_loss = fail`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from meshrl.config.launch import LaunchConfig

log = logging.getLogger(__name__)


class HostLost(RuntimeError):
    """Hosts were lost and the run cannot (or may not) continue without them."""


class Hosts:
    """Host meshes by name. ``probe()`` returns the hosts known to be lost now, as
    ``{host mesh: {host index, ...}}`` (launchers that cannot tell return nothing)."""

    def __init__(self, host_meshes: dict[str, Any], cfg: LaunchConfig,
                 probe: Callable[[], dict[str, set[int]]] | None = None,
                 on_spawn: Callable[[Any], None] | None = None, label_logs: bool = False):
        """``on_spawn(proc_mesh)`` runs after every proc mesh is created (log forwarding);
        ``label_logs`` prefixes every actor process's log records with its mesh and rank."""
        missing = sorted(set(cfg.hosts) - set(host_meshes))
        if missing:
            raise HostLost(f"the launcher provided no host mesh {missing[0]!r} (launch.hosts)")
        self.cfg = cfg
        self._meshes = host_meshes
        self._probe = probe
        self._on_spawn = on_spawn
        self.label_logs = label_logs
        self.lost: dict[str, set[int]] = {name: set() for name in cfg.hosts}
        self.events: list[dict] = []  # one per host found lost: host mesh, index

    @classmethod
    def local(cls, cfg: LaunchConfig) -> "Hosts":
        """Every host mesh is this machine (the `local` launcher, and tests composing a Runtime)."""
        from monarch.actor import this_host

        host = this_host()
        return cls({name: host for name in cfg.hosts}, cfg)

    def on_spawn(self, proc_mesh) -> None:
        """Tell the launcher about a new proc mesh."""
        if self._on_spawn is not None:
            self._on_spawn(proc_mesh)

    def group_of(self, mesh: str) -> str:
        """The host mesh actor mesh ``mesh`` runs on (`launch.place`)."""
        return self.cfg.host_mesh_of(mesh)

    def alive(self, group: str) -> list[int]:
        """Indices of the hosts of ``group`` not known to be lost."""
        return [i for i in range(self.cfg.hosts[group]) if i not in self.lost[group]]

    def count(self, group: str) -> int:
        """Hosts of ``group`` a spawn uses now: the longest run of consecutive surviving hosts."""
        return len(self._usable(group))

    def _usable(self, group: str) -> list[int]:
        runs: list[list[int]] = []
        for i in self.alive(group):
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return max(runs, key=len) if runs else []

    def host_mesh(self, group: str):
        """The HostMesh a spawn on ``group`` uses: all of it, or its surviving hosts."""
        usable = self._usable(group)
        if not usable:
            raise HostLost(f"every host of host mesh '{group}' is lost (launch.hosts.{group} = {self.cfg.hosts[group]})")
        if len(usable) == self.cfg.hosts[group]:
            return self._meshes[group]
        return self._meshes[group].slice(hosts=slice(usable[0], usable[-1] + 1))

    def refresh(self) -> list[tuple[str, int]]:
        """Ask the launcher which hosts are gone; returns the newly lost ``(host mesh, index)``.
        Raises HostLost under `launch.on_host_loss = fail`."""
        if self._probe is None:
            return []
        new = []
        for group, indices in self._probe().items():
            for i in sorted(set(indices) - self.lost.get(group, set())):
                self.lost.setdefault(group, set()).add(i)
                new.append((group, i))
                self.events.append({"host_mesh": group, "host": i})
                log.warning("host %d of host mesh '%s' is lost", i, group)
        if new and self.cfg.on_host_loss == "fail":
            group, i = new[0]
            raise HostLost(f"host {i} of host mesh '{group}' is lost (launch.on_host_loss = fail)")
        return new
