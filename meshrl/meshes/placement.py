"""GPU placement: which host GPUs each process of each mesh sees.

`plan_run` turns a run's config and the host's GPUs into a `Placement` (one row per mesh process)
and rejects what cannot work (overlapping devices between meshes that do not share processes, more
GPUs than the host has) with a one-line `PlacementError` naming the config key. `MeshGroup` spawns
each proc mesh with the placement's `VisibleDevices` bootstrap, which sets CUDA_VISIBLE_DEVICES in
every process before anything there initialises CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
from dataclasses import dataclass

from meshrl.config.base import ConfigError
from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import (ENV, GENERATOR, LEARNER, MESH_NAMES, REPLAY_REFERENCE, REWARDER, SDPO_TEACHER,
                                  TEACHER_REPLAY, MeshSpec, check_colocation)
from meshrl.config.run import RunConfig
from meshrl.meshes.auto_gpus import GpuChoice, cpu_if_auto, resolve_gpus
from meshrl.training.gpu_budget import MEMORY_FRACTION_ENV


class PlacementError(ConfigError):
    """A placement that cannot work on this host, in one line naming the config key."""


def host_gpu_ids() -> tuple[str, ...]:
    """The GPUs this controller may hand out, as CUDA_VISIBLE_DEVICES entries, found without
    initialising CUDA here: the controller's own CUDA_VISIBLE_DEVICES when set (up to its first
    invalid entry, as CUDA reads it), else one index per GPU `nvidia-smi -L` lists (none when
    there is no nvidia-smi)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for entry in (e.strip() for e in visible.split(",")):
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            ids.append(entry)
        return tuple(ids)
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(str(i) for i in range(sum(line.startswith("GPU ") for line in listing.splitlines())))


@dataclass(frozen=True)
class Slot:
    """A mesh to place: the name `MeshGroup` spawns it under, the config key that describes it
    (for error messages) and that key's value."""

    name: str
    key: str
    spec: MeshSpec


@dataclass(frozen=True)
class PlacementRow:
    """One process: mesh, rank in its mesh, host, host GPU indices it sees, the mesh whose
    processes it shares (None = its own) and its share of those GPUs' memory (None = all)."""

    mesh: str
    rank: int
    host: str
    devices: tuple[int, ...]
    shares: str | None = None
    memory_fraction: float | None = None


@dataclass(frozen=True)
class VisibleDevices:
    """A proc mesh's bootstrap: sets CUDA_VISIBLE_DEVICES to ``per_rank[r]`` in process r (an empty
    string hides every GPU), the PCI bus device order `nvidia-smi` numbers by, unless set, and the
    process's GPU memory share when the mesh has one (`claim_device` applies it)."""

    per_rank: tuple[str, ...]
    memory_fraction: float | None = None

    def __call__(self) -> None:
        from monarch.actor import current_rank

        os.environ["CUDA_VISIBLE_DEVICES"] = self.per_rank[local_rank(current_rank())]
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        if self.memory_fraction is not None:
            os.environ[MEMORY_FRACTION_ENV] = str(self.memory_fraction)


def local_rank(point) -> int:
    """A process's index among the processes of its mesh on its own host (every host of a host
    mesh runs the same layout)."""
    try:
        return point["procs"]
    except (KeyError, IndexError, TypeError):
        return point.rank


@dataclass(frozen=True)
class Placement:
    """Every mesh process of a run and the GPUs it sees; ``gpu_ids[i]`` is what host GPU index i
    means in CUDA_VISIBLE_DEVICES."""

    gpu_ids: tuple[str, ...]
    rows: tuple[PlacementRow, ...]

    def devices(self, mesh: str) -> list[tuple[int, ...]]:
        """Host GPU indices of each process of ``mesh``, by rank."""
        return [row.devices for row in self.rows if row.mesh == mesh]

    def bootstrap(self, mesh: str, procs: int) -> VisibleDevices | None:
        """The bootstrap for ``mesh``'s ``procs`` processes; None when the host has no GPUs (the
        processes have nothing to hide or pick, and skipping the bootstrap saves its start)."""
        if not self.gpu_ids:
            return None
        per_rank = self.devices(mesh)
        if len(per_rank) != procs:
            raise ValueError(f"mesh '{mesh}' spawns {procs} process(es) but its placement has {len(per_rank)}")
        fraction = next(row.memory_fraction for row in self.rows if row.mesh == mesh)
        return VisibleDevices(tuple(",".join(self.gpu_ids[d] for d in devs) for devs in per_rank), fraction)

    def with_mesh(self, name: str, spec: MeshSpec) -> "Placement":
        """This placement plus mesh ``name`` (declared after planning) on the lowest GPUs that no
        planned process uses; raises PlacementError when they are too few."""
        taken = {d for row in self.rows for d in row.devices}
        free = [d for d in range(len(self.gpu_ids)) if d not in taken]
        need = spec.procs * spec.gpus_per_proc
        if need > len(free):
            raise PlacementError(f"mesh '{name}': {spec.procs} process(es) x {spec.gpus_per_proc} GPU(s) need {need} "
                                 f"but only {len(free)} of the host's {len(self.gpu_ids)} are free")
        per = spec.gpus_per_proc
        host = self.rows[0].host if self.rows else socket.gethostname()
        rows = [PlacementRow(name, r, host, tuple(free[r * per:(r + 1) * per])) for r in range(spec.procs)]
        return Placement(self.gpu_ids, self.rows + tuple(rows))

    def table(self) -> str:
        """The plan as an aligned text table (mesh, process, host, devices, shared processes)."""
        head = ("mesh", "proc", "host", "devices", "shares")
        body = [(r.mesh, str(r.rank), r.host, _devices_cell(r), r.shares or "-") for r in self.rows]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]) + "\n"


def _devices_cell(row: PlacementRow) -> str:
    """A row's GPUs for the table, with its memory share when it has one (`0 (45%)`)."""
    cell = ",".join(map(str, row.devices)) or "cpu"
    return cell if row.memory_fraction is None or not row.devices else f"{cell} ({row.memory_fraction:.0%})"


def replay_reference_mesh(cfg: RunConfig) -> bool:
    """Whether the run has the replay pairs' reference actor: it trains on its own replay pairs
    (not a generation job, not a learner of shards) with `replay.reference.source: precomputed`."""
    return cfg.replay.beta > 0 and cfg.replay.reference.source == "precomputed" and cfg.diloco.role == "train"


def run_slots(cfg: RunConfig) -> list[Slot]:
    """Every mesh a run spawns, in placement order: learner, generator, the rewarder's slot (the
    env mesh for the code task; none for an agent program's, which runs beside the controller), then
    the SDPO teacher (its own mesh: `sdpo.teacher = mesh`) and the teacher replay pool and its pairs'
    reference actor (`replay.reference.source = precomputed`) when enabled."""
    m = cfg.meshes
    slots = [Slot(LEARNER, "meshes.learner", m.learner), Slot(GENERATOR, "meshes.generator", m.generator)]
    if cfg.task.kind != "agent":
        slots.append(Slot(ENV if cfg.task.kind == "code" else REWARDER, "meshes.rewarder", m.rewarder))
    if cfg.sdpo.alpha > 0 and cfg.sdpo.teacher == "mesh":
        slots.append(Slot(SDPO_TEACHER, "sdpo.mesh", cfg.sdpo.mesh))
    if cfg.replay.beta > 0:
        slots.append(Slot(TEACHER_REPLAY, "replay.pool", MeshSpec(procs=cfg.replay.pool.procs, gpus_per_proc=0)))
        if replay_reference_mesh(cfg):
            slots.append(Slot(REPLAY_REFERENCE, "replay.reference.mesh", cfg.replay.reference.mesh))
    return slots


def remote_host_gpus(launch: LaunchConfig) -> int | None:
    """GPUs each host of a remote launcher offers (`launch.slurm.gpus_per_node`,
    `launch.k8s.gpus_per_pod`); None for launchers whose hosts are this machine."""
    if launch.launcher == "slurm":
        return launch.slurm.gpus_per_node or 0
    if launch.launcher == "k8s":
        return launch.k8s.gpus_per_pod
    return None


def plan_run(cfg: RunConfig, gpu_ids: tuple[str, ...] | None = None, host: str | None = None) -> Placement:
    """The placement of every mesh of ``cfg`` on GPUs ``gpu_ids`` per host (default:
    `gpus_for(cfg.launch)`). Launchers whose hosts are this machine (`local`, `process`) place every
    mesh on its GPUs together; remote launchers place each host mesh's meshes on its own hosts.
    A `gpus_per_proc: auto` left in ``cfg`` is decided here as `resolve_gpus` decides it (the
    processes must be spawned from the same decision: `MeshSession` resolves its config too)."""
    ids = gpus_for(cfg.launch) if gpu_ids is None else gpu_ids
    cfg = resolve_gpus(cfg, len(ids)).cfg
    slots = run_slots(cfg)
    if cfg.launch.launcher == "local":
        return plan(slots, ids, host or socket.gethostname())
    by_name = {s.name: s for s in slots}
    if remote_host_gpus(cfg.launch) is None:  # host workers on this machine share its GPUs
        placed = plan(slots, ids, "")
        rows = [dataclasses.replace(r, host=_hosts_label(cfg, _owner_name(by_name[r.mesh]))) for r in placed.rows]
    else:
        rows = []
        for group in cfg.launch.hosts:
            mine = [s for s in slots if cfg.launch.host_mesh_of(_owner_name(s)) == group]
            if mine:
                rows += plan(mine, ids, _hosts_label(cfg, mine[0].name)).rows
    order = list(by_name)
    return Placement(ids, tuple(sorted(rows, key=lambda r: (order.index(r.mesh), r.rank))))


def _hosts_label(cfg: RunConfig, mesh: str) -> str:
    """``<host mesh> x<hosts>`` for the table's host column: every process row runs on each host."""
    group = cfg.launch.host_mesh_of(mesh)
    return f"{group} x{cfg.launch.hosts[group]}"


def _owner_name(slot: Slot) -> str:
    """The mesh whose processes ``slot`` uses (a co-located mesh lives where its host mesh does)."""
    return slot.spec.colocate_with or slot.name


def resolve_run(cfg: RunConfig, colocate: bool = True) -> GpuChoice:
    """``cfg`` with `gpus_per_proc: auto` decided for the GPUs its launcher's hosts offer
    (`resolve_gpus`; ``colocate=False`` for front ends whose generators need processes of their own)."""
    return resolve_gpus(cfg, len(gpus_for(cfg.launch)), colocate)


def gpus_for(launch: LaunchConfig) -> tuple[str, ...]:
    """The GPUs each host of ``launch`` offers: this machine's for `local` and `process`."""
    remote = remote_host_gpus(launch)
    return host_gpu_ids() if remote is None else tuple(str(i) for i in range(remote))


def plan(slots: list[Slot], gpu_ids: tuple[str, ...], host: str) -> Placement:
    """Place ``slots`` (in order) on a host with ``gpu_ids``: explicit `devices` first, then each
    mesh without them takes the lowest free indices; co-located meshes see their host mesh's. A
    slot still at `gpus_per_proc: auto` (a mesh outside a run's decision) is a CPU mesh."""
    slots = [dataclasses.replace(s, spec=cpu_if_auto(s.spec)) for s in slots]
    by_name = {s.name: s for s in slots}
    owners = [s for s in slots if s.spec.colocate_with is None]
    for s in slots:
        _check_colocation(s, by_name)
    taken: dict[int, str] = {}
    shares: dict[int, list[Slot]] = {}
    assigned: dict[str, list[int]] = {}
    for s in owners:
        if s.spec.devices is not None:
            for d in s.spec.devices:
                if d >= len(gpu_ids):
                    raise PlacementError(f"{s.key}.devices = {s.spec.devices}: GPU {d} is not on the host "
                                         f"({_has(gpu_ids)})")
                shares.setdefault(d, []).append(s)
                if d in taken:
                    _check_shared_gpu(d, shares[d])
                taken[d] = s.key
            assigned[s.name] = list(s.spec.devices)
    for s in owners:
        if s.spec.devices is None:
            need = s.spec.procs * s.spec.gpus_per_proc
            free = [d for d in range(len(gpu_ids)) if d not in taken]
            if need > len(free):
                left = f"only {len(free)} of the host's {len(gpu_ids)} are free" if gpu_ids else "the host has none"
                raise PlacementError(f"{s.key}.gpus_per_proc = {s.spec.gpus_per_proc}: {s.spec.procs} process(es) "
                                     f"need {need} GPU(s) but {left}")
            assigned[s.name] = free[:need]
            taken.update((d, s.key) for d in free[:need])
    rows = []
    for s in slots:
        owner = by_name[s.spec.colocate_with] if s.spec.colocate_with else s
        devs, per = assigned[owner.name], owner.spec.gpus_per_proc
        rows += [PlacementRow(s.name, r, host, tuple(devs[r * per:(r + 1) * per]), s.spec.colocate_with,
                              owner.spec.gpu_memory_fraction) for r in range(owner.spec.procs)]
    return Placement(tuple(gpu_ids), tuple(rows))


def _check_shared_gpu(gpu: int, slots: list[Slot]) -> None:
    """Meshes that name the same GPU must each have a memory share, together at most all of it."""
    s = slots[-1]
    unbudgeted = [x.key for x in slots if x.spec.gpu_memory_fraction is None]
    if unbudgeted:
        raise PlacementError(f"{s.key}.devices = {s.spec.devices}: GPU {gpu} is already {slots[0].key}'s "
                             f"(meshes share a GPU co-located or with a gpu_memory_fraction each; {unbudgeted[0]} "
                             "has none)")
    total = sum(x.spec.gpu_memory_fraction for x in slots)
    if total > 1:
        raise PlacementError(f"{s.key}.gpu_memory_fraction = {s.spec.gpu_memory_fraction}: the meshes on GPU {gpu} "
                             f"({', '.join(x.key for x in slots)}) would take {total:.2f} of its memory")


def _check_colocation(slot: Slot, by_name: dict[str, Slot]) -> None:
    """A co-located mesh must name a planned mesh with processes of its own, as many as it has."""
    target = slot.spec.colocate_with
    if target is None:
        return
    if target not in by_name:
        raise PlacementError(f"{slot.key}.colocate_with = {target!r}: this run spawns no {target} mesh (the code "
                             f"task's env mesh takes the rewarder's place); choose one of "
                             f"{[n for n in MESH_NAMES if n in by_name]}")
    try:
        check_colocation(slot.key, slot.spec, by_name[target].key, by_name[target].spec)
    except ValueError as e:
        raise PlacementError(str(e)) from None


def _has(gpu_ids: tuple[str, ...]) -> str:
    return f"it has GPUs 0-{len(gpu_ids) - 1}" if gpu_ids else "it has none"
