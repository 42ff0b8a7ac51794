"""`gpus_per_proc: auto`: the GPU layout a run gets when its config leaves it to the host.

`resolve_gpus` turns every `auto` of a run's meshes into a number (and, with one GPU, the
generator's co-location with the learner) for a host with a given number of GPUs, and says why in
one line per decision, which `meshrl plan` and `--dry-run` print. What a config sets explicitly is
kept: `auto` only decides for the meshes that left it open.

- no GPUs: every mesh on the CPU (the plan of a CPU host is the one it always was);
- one GPU: the learner on it and the generator in the learner's processes (co-located), the
  layout measured fastest on one GPU; where co-location cannot be (asynchronous training, several
  optimizer steps per step, a sharded learner, or a front end whose generators need processes of
  their own: the API), learner and generator share the GPU as two processes with a memory share
  each (`gpu_memory_fraction`: LEARNER_SHARE and GENERATOR_SHARE);
- N GPUs: one per learner process from GPU 0 up, then one per generator replica on the rest
  (N - learner processes replicas unless `meshes.generator.procs` is set);
- every other mesh (rewarder, env, channel meshes) stays on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from meshrl.config.base import ConfigError, format_validation_error
from meshrl.config.meshes import GENERATOR, LEARNER, SDPO_TEACHER, MeshSpec
from meshrl.config.run import RunConfig

AUTO = "auto"
LEARNER_SHARE, GENERATOR_SHARE = 0.5, 0.4
"""GPU memory shares of a learner and a generator process that `auto` puts on one GPU together."""


def shared_gpu_overrides(gpu: int = 0) -> list[str]:
    """The dotted overrides that put the learner and the generator in processes of their own on
    GPU ``gpu``, with the memory shares `auto` gives them there."""
    return [f"meshes.{LEARNER}.devices=[{gpu}]", f"meshes.{LEARNER}.gpu_memory_fraction={LEARNER_SHARE}",
            f"meshes.{GENERATOR}.devices=[{gpu}]", f"meshes.{GENERATOR}.gpu_memory_fraction={GENERATOR_SHARE}"]


@dataclass(frozen=True)
class GpuChoice:
    """A run's config with no `auto` left, and one line per decision `auto` made."""

    cfg: RunConfig
    reasons: tuple[str, ...]


def resolve_gpus(cfg: RunConfig, gpus: int, colocate: bool = True) -> GpuChoice:
    """``cfg`` with every `gpus_per_proc: auto` decided for hosts of ``gpus`` GPUs each;
    ``colocate=False`` for front ends whose generators must have processes of their own."""
    m = cfg.meshes
    if AUTO not in (m.learner.gpus_per_proc, m.generator.gpus_per_proc, m.rewarder.gpus_per_proc,
                    cfg.sdpo.mesh.gpus_per_proc):
        return GpuChoice(cfg, ("every mesh sets gpus_per_proc: the config's layout",))
    learner, generator = m.learner, m.generator
    free = _free_gpus(cfg, gpus)
    reasons: list[str] = []
    if learner.gpus_per_proc == AUTO:
        learner, line = _own_gpus(LEARNER, learner, free[_host(cfg, LEARNER)], gpus)
        reasons.append(line)
        free[_host(cfg, LEARNER)] -= learner.procs * learner.gpus_per_proc
    if generator.gpus_per_proc == AUTO:
        shared = any(s.colocate_with == GENERATOR for s in (learner, m.rewarder, cfg.sdpo.mesh))
        colocate, why_not = (False, "this front end gives generators processes of their own") if not colocate \
            else _colocation_blocker(cfg)
        generator, line = _generator(generator, learner, free[_host(cfg, GENERATOR)], gpus, colocate,
                                     _host(cfg, GENERATOR) == _host(cfg, LEARNER), shared)
        if generator.devices is None and generator.gpus_per_proc == 0 and generator.colocate_with is None \
                and _can_share(generator, learner, gpus, m.learner.gpus_per_proc == AUTO):
            learner = learner.model_copy(update={"devices": [0], "gpu_memory_fraction": LEARNER_SHARE})
            generator = generator.model_copy(update={"devices": [0], "gpus_per_proc": 1,
                                                     "gpu_memory_fraction": GENERATOR_SHARE})
            line = (f"meshes.{GENERATOR}: its own process on the learner's GPU 0, {GENERATOR_SHARE:.0%} of its memory "
                    f"against the learner's {LEARNER_SHARE:.0%} (not co-located: {why_not})")
        reasons.append(line)
    meshes = m.model_copy(update={LEARNER: learner, GENERATOR: generator,
                                  "rewarder": cpu_if_auto(m.rewarder)})
    resolved = cfg.model_copy(update={"meshes": meshes, "sdpo": cfg.sdpo.model_copy(update={"mesh": cpu_if_auto(cfg.sdpo.mesh)})})
    others = [("meshes.rewarder", m.rewarder)]
    if cfg.sdpo.alpha > 0 and cfg.sdpo.teacher == "mesh":
        others.append(("sdpo.mesh", cfg.sdpo.mesh))
    others = [key for key, spec in others if spec.gpus_per_proc == AUTO and spec.colocate_with is None]
    if others and gpus:
        reasons.append(f"{', '.join(others)}: on the CPU (auto gives GPUs to the learner and generator only)")
    try:  # the decided layout meets every rule an explicit one meets
        resolved = type(cfg).model_validate(resolved.model_dump())  # an SFT run keeps its `sft` section
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, f"the automatic GPU layout ({'; '.join(reasons)})")) from None
    return GpuChoice(resolved, tuple(reasons))


def _colocation_blocker(cfg: RunConfig) -> tuple[bool, str]:
    """(whether the generator may share the learner's processes, why not): it samples with the
    learner's parameters, which must not change under a generation and must all be in each process."""
    tc = cfg.trainer
    if tc.max_steps_off_policy:
        return False, f"trainer.max_steps_off_policy = {tc.max_steps_off_policy}"
    if tc.num_substeps > 1:
        return False, f"trainer.num_substeps = {tc.num_substeps}"
    if cfg.meshes.learner.procs > 1 and cfg.learner.data_parallel == "fsdp2":
        return False, "learner.data_parallel = 'fsdp2' shards the weights"
    return True, ""


def _can_share(generator: MeshSpec, learner: MeshSpec, gpus: int, learner_auto: bool) -> bool:
    """Whether `auto` may put one generator process beside the one learner process on a host's
    only GPU (each with a memory share): the learner's layout is `auto`'s own to set."""
    return (gpus == 1 and learner_auto and learner.gpus_per_proc == 1 and learner.devices is None
            and learner.procs == 1 and generator.procs == 1)


def _free_gpus(cfg: RunConfig, gpus: int) -> dict[str, int]:
    """GPUs per host mesh that meshes with an explicit count leave for `auto`."""
    free = {group: gpus for group in ("", *cfg.launch.hosts)}
    placed = [(LEARNER, cfg.meshes.learner), (GENERATOR, cfg.meshes.generator), ("rewarder", cfg.meshes.rewarder)]
    if cfg.sdpo.alpha > 0 and cfg.sdpo.teacher == "mesh":
        placed.append((SDPO_TEACHER, cfg.sdpo.mesh))
    for name, spec in placed:
        if spec.colocate_with is None and spec.gpus_per_proc != AUTO:
            free[_host(cfg, name)] -= spec.procs * spec.gpus_per_proc
    return free


def _host(cfg: RunConfig, mesh: str) -> str:
    """The GPUs ``mesh`` draws from: its host mesh's hosts under a remote launcher, else this
    machine's (one pool for every mesh)."""
    return cfg.launch.host_mesh_of(mesh) if cfg.launch.launcher in ("slurm", "k8s") else ""


def _per_proc(spec: MeshSpec) -> int | None:
    """What `auto` means for a mesh with explicit `devices` (their count per process)."""
    return None if spec.devices is None else len(spec.devices) // spec.procs


def _own_gpus(name: str, spec: MeshSpec, free: int, gpus: int) -> tuple[MeshSpec, str]:
    """One GPU per process of mesh ``name`` when ``free`` GPUs suffice, else the CPU."""
    key = f"meshes.{name}"
    if spec.colocate_with is not None:
        return spec.model_copy(update={"gpus_per_proc": 0}), f"{key}: shares {spec.colocate_with}'s processes and GPUs"
    if _per_proc(spec) is not None:
        return spec.model_copy(update={"gpus_per_proc": _per_proc(spec)}), f"{key}: on its devices {spec.devices}"
    if gpus == 0:
        return spec.model_copy(update={"gpus_per_proc": 0}), f"{key}: on the CPU (no GPU found)"
    if free < spec.procs:
        return (spec.model_copy(update={"gpus_per_proc": 0}),
                f"{key}: on the CPU ({spec.procs} process(es) need a GPU each, {max(free, 0)} free)")
    return spec.model_copy(update={"gpus_per_proc": 1}), f"{key}: one GPU per process ({spec.procs})"


def _generator(spec: MeshSpec, learner: MeshSpec, free: int, gpus: int, colocate: bool,
               same_host: bool, shared: bool) -> tuple[MeshSpec, str]:
    """The generator's GPUs: replicas on the GPUs the learner left, else the learner's GPU;
    ``shared``: another mesh shares its processes, so their number stays."""
    key = f"meshes.{GENERATOR}"
    if spec.colocate_with is not None or _per_proc(spec) is not None or gpus == 0:
        return _own_gpus(GENERATOR, spec, free, gpus)
    if free >= 1 and "procs" not in spec.model_fields_set and not shared:
        return (spec.model_copy(update={"gpus_per_proc": 1, "procs": free}),
                f"{key}: {free} replica(s), one per GPU the learner leaves")
    if free >= spec.procs:
        return spec.model_copy(update={"gpus_per_proc": 1}), f"{key}: one GPU per replica ({spec.procs})"
    learner_on_gpu = learner.colocate_with is None and learner.gpus_per_proc != 0
    if learner_on_gpu and same_host and colocate and spec.procs == learner.procs:
        return (spec.model_copy(update={"gpus_per_proc": 0, "colocate_with": LEARNER}),
                f"{key}: co-located with the learner on its GPU (no GPU left for a replica of its own)")
    why = "co-location is ruled out" if learner_on_gpu and not colocate else \
        f"{spec.procs} replica(s) need a GPU each, {max(free, 0)} free"
    return spec.model_copy(update={"gpus_per_proc": 0}), f"{key}: on the CPU ({why})"


def cpu_if_auto(spec: MeshSpec) -> MeshSpec:
    """A mesh `auto` does not place on GPUs (rewarder, env, channel meshes, meshes of no run): the
    CPU, or its explicit `devices`."""
    if spec.gpus_per_proc != AUTO:
        return spec
    return spec.model_copy(update={"gpus_per_proc": _per_proc(spec) or 0})
