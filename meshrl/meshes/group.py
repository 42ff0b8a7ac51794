"""MeshGroup: spawns one proc mesh per mesh name (or shares one when co-located) on the host mesh
the launch config places it on, each process seeing only the GPUs its placement gives it, and the
actor meshes on them; waits for their setup with a deadline, replaces a damaged proc mesh (on the
same GPUs, and on the surviving hosts after a host loss) together with every actor mesh on it, and
stops everything on exit."""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

import psutil

from meshrl.config.meshes import MeshesConfig, MeshSpec
from meshrl.meshes.hosts import Hosts
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


@dataclass(frozen=True)
class MeshDecl:
    """A mesh of your own actors: ``procs`` processes of ``actor(*args, **kwargs)`` on every host of
    ``host_mesh`` (None = the host mesh `launch.place` gives ``name``, else the first), each
    process seeing ``gpus_per_proc`` GPUs and with ``env`` set before the actor starts."""

    name: str
    actor: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    procs: int = 1
    host_mesh: str | None = None
    gpus_per_proc: int = 0
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ProcSetup:
    """A proc mesh's bootstrap: its GPU visibility (None = inherit), extra environment, and (with
    ``label``) log records prefixed ``[label rN]`` so that forwarded lines name their mesh."""

    devices: Any = None
    env: tuple[tuple[str, str], ...] = ()
    label: str | None = None

    def __call__(self) -> None:
        os.environ.update(dict(self.env))
        if self.devices is not None:
            self.devices()
        if self.label is not None:
            from monarch.actor import current_rank

            logging.basicConfig(level=logging.WARNING, force=True,
                                format=f"[{self.label} r{current_rank().rank}] %(levelname)s %(name)s: %(message)s")


class MeshGroup:
    """The run's proc meshes and actor meshes, by name. Each mesh runs `procs` processes on every
    usable host of its host mesh (``hosts``). With a ``placement`` every proc mesh is spawned with
    its bootstrap (CUDA_VISIBLE_DEVICES per process); without one, processes inherit the
    controller's CUDA environment."""

    def __init__(self, cfg: MeshesConfig, hosts: Hosts, placement: Placement | None = None,
                 actors: dict[str, type] | None = None):
        self.cfg = cfg
        self.hosts = hosts
        self.placement = placement
        self.overrides = dict(actors or {})  # mesh name -> actor class spawned instead of the standard one
        self._env: dict[str, dict] = {}
        self._host_mesh: dict[str, str] = {}
        self.proc_meshes: dict[str, Any] = {}
        self.actor_meshes: dict[str, Any] = {}
        self.pids: dict[str, list[int]] = {}
        self.infos: dict[str, list[dict]] = {}
        self._specs: dict[str, _ActorSpec] = {}
        self._extra_meshes: dict[str, MeshSpec] = {}
        self._stopping: list[tuple[str, Any]] = []  # (name, stop future) of replaced proc meshes
        self.generation: dict[str, int] = {}
        self._host_count: dict[str, int] = {}  # hosts each live proc mesh spans

    def procs_of(self, name: str) -> int:
        """Number of processes (= actors) of mesh ``name``: its processes per host times the hosts
        its proc mesh was spawned on."""
        owner = self._owner(name)
        return self._mesh_spec(owner).procs * self._host_count.get(owner, self.hosts.count(self._group(owner)))

    def _mesh_spec(self, name: str) -> MeshSpec:
        if name in self._extra_meshes:
            return self._extra_meshes[name]
        return getattr(self.cfg, name)

    def add_mesh(self, name: str, procs: int, colocate_with: str | None = None) -> None:
        """Declare a mesh that is not part of MeshesConfig (e.g. a loss term's actors). A mesh of
        that name from an earlier run with another layout loses its processes."""
        spec = MeshSpec(procs=procs, colocate_with=colocate_with)
        if self._extra_meshes.get(name, spec) != spec and name in self.proc_meshes:
            self._stopping.append((name, self.proc_meshes.pop(name).stop()))
        self._extra_meshes[name] = spec

    def declare(self, decl: MeshDecl):
        """Spawn a mesh of your own actors (see `MeshDecl`); call `wait_ready` before use."""
        if decl.name in self._specs or decl.name in self._extra_meshes:
            raise ValueError(f"mesh '{decl.name}' already exists")
        if decl.host_mesh is not None and decl.host_mesh not in self.hosts.cfg.hosts:
            raise ValueError(f"mesh '{decl.name}': host_mesh {decl.host_mesh!r} is not in launch.hosts "
                             f"{sorted(self.hosts.cfg.hosts)}")
        spec = MeshSpec(procs=decl.procs, gpus_per_proc=decl.gpus_per_proc)
        if self.placement is not None:
            self.placement = self.placement.with_mesh(decl.name, spec)
        self._extra_meshes[decl.name] = spec
        self._env[decl.name] = dict(decl.env)
        if decl.host_mesh is not None:
            self._host_mesh[decl.name] = decl.host_mesh
        return self.spawn(decl.name, decl.actor, *decl.args, **decl.kwargs)

    def _group(self, owner: str) -> str:
        return self._host_mesh.get(owner) or self.hosts.group_of(owner)

    def _owner(self, name: str) -> str:
        return self._mesh_spec(name).colocate_with or name

    def _procs(self, owner: str):
        if owner not in self.proc_meshes:
            count = self._mesh_spec(owner).procs
            self.generation[owner] = self.generation.get(owner, -1) + 1
            devices = self.placement.bootstrap(owner, count) if self.placement is not None else None
            env = tuple(sorted(self._env.get(owner, {}).items()))
            label = owner if self.hosts.label_logs else None
            bootstrap = ProcSetup(devices, env, label) if (devices is not None or env or label) else None
            group = self._group(owner)
            self._host_count[owner] = self.hosts.count(group)
            self.proc_meshes[owner] = self.hosts.host_mesh(group).spawn_procs(
                per_host={"procs": count}, name=f"{owner}-g{self.generation[owner]}", bootstrap=bootstrap
            )
            try:  # log forwarding waits for the processes to start
                self.hosts.on_spawn(self.proc_meshes[owner])
            except Exception as e:  # noqa: BLE001 - Monarch raises a bare ValueError for a spawn that failed
                raise MeshSpawnError(f"mesh '{owner}': its processes did not start: {first_line(e)}") from None
        return self.proc_meshes[owner]

    def spawn(self, name: str, actor_cls: type, *args, **kwargs):
        """Spawn actor mesh ``name`` (non-blocking; call `wait_ready` before use). A `Rendezvous`
        among the arguments becomes the address of a free port on the mesh's first process. An
        actor mesh of that name already there (an earlier run's) is stopped first."""
        if name in self.actor_meshes:
            self._stop_actor_mesh(name)
        spec = _ActorSpec(self._owner(name), self.overrides.get(name, actor_cls), args, kwargs)
        self._specs[name] = spec
        self.actor_meshes[name] = self._spawn_actors(name, spec)
        return self.actor_meshes[name]

    def _spawn_actors(self, name: str, spec: _ActorSpec):
        from meshrl.meshes.rendezvous import resolve_rendezvous

        procs = self._procs(spec.owner)
        args = resolve_rendezvous(procs, self.procs_of(name), spec.args, self.cfg.spawn_timeout_s)
        return procs.spawn(name, spec.actor_cls, *args, **spec.kwargs)

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
        lost = self.hosts.refresh()  # a lost host is left out of the replacement (or stops the run)
        old = self.proc_meshes.pop(owner, None)
        if old is not None:
            # a hung process would hold its memory and cores while the replacement starts
            for n in names:
                for pid in self.pids.pop(n, []):
                    _kill_tree(pid)
            if any(group == self._group(owner) for group, _ in lost):
                log.warning("abandoning mesh '%s': one of its hosts is lost (stopping it would hang)", owner)
            else:  # stop the damaged mesh in the background: the replacement need not wait for it
                self._stopping.append((owner, old.stop()))
        try:
            self._bring_up(names)
        except MeshSpawnError as e:
            # a host that failed with the mesh can still look alive for a moment (a killed worker
            # that is still exiting), and the replacement then waits for it in vain; once the
            # host is seen lost, the replacement comes up on the surviving hosts
            if not any(group == self._group(owner) for group, _ in self.hosts.refresh()):
                raise
            log.warning("mesh '%s' did not come up on a host that is now lost (%s); spawning it on the "
                        "surviving hosts", owner, e)
            self.proc_meshes.pop(owner)  # abandoned: stopping a mesh on a lost host would hang
            self._bring_up(names)
        return names

    def _bring_up(self, names: list[str]) -> None:
        for n in names:
            self.actor_meshes[n] = self._spawn_actors(n, self._specs[n])
        self.wait_ready(names)

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

    def _stop_actor_mesh(self, name: str, timeout_s: float = 30.0) -> None:
        actors = self.actor_meshes.pop(name)
        self._specs.pop(name, None)
        self.pids.pop(name, None)
        self.infos.pop(name, None)
        try:
            actors.stop().get(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - its processes stay under supervision all the same
            log.warning("stopping actor mesh '%s' failed: %s", name, first_line(e))

    def stop_actors(self) -> None:
        """Stop every actor mesh; the processes stay, for the actors of a next run (a proc mesh with
        a dead process is dropped: the next run gets new processes there)."""
        for owner in {self._owner(name) for name in self.actor_meshes}:
            if owner in self.proc_meshes and self.dead_process(owner):
                self._stopping.append((owner, self.proc_meshes.pop(owner).stop()))
        for name in list(self.actor_meshes):
            self._stop_actor_mesh(name)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every proc mesh (and finish stopping replaced ones); a mesh on a host known to be
        lost is abandoned (stopping it would hang), and one that will not stop is logged and
        abandoned."""
        lost = {group for group, hosts in self.hosts.lost.items() if hosts}
        for name in [n for n in self.proc_meshes if self._group(n) in lost]:
            log.warning("abandoning mesh '%s': one of its hosts is lost (stopping it would hang)", name)
            self.proc_meshes.pop(name)
        stopping = []
        for name, fut in self._stopping:  # a replaced mesh whose host was seen lost only after its stop began
            if self._group(name) in lost:
                log.warning("abandoning the stop of replaced mesh '%s': one of its hosts is lost", name)
            else:
                stopping.append((name, fut))
        futures = [(name, pm.stop()) for name, pm in self.proc_meshes.items()] + stopping
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
