"""Where the run's hosts come from: this machine, local host workers, a SLURM allocation or
Kubernetes pods (Monarch's job launchers), and which actor mesh lives on which host mesh."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from meshrl.config.base import Section
from meshrl.config.meshes import ENV, MESH_NAMES, REPLAY_REFERENCE, SDPO_TEACHER, TEACHER_REPLAY

RUN_MESHES = (*MESH_NAMES, ENV, SDPO_TEACHER, TEACHER_REPLAY, REPLAY_REFERENCE)
"""Every actor mesh a standard run can spawn (the keys `launch.place` accepts)."""

_NAME = r"^[a-z][a-z0-9_-]{0,39}$"
_K8S_MESH_NAME = r"^[a-z][a-z0-9]{0,39}$"
"""Host mesh names under Kubernetes: they name MonarchMesh resources, which Monarch restricts to
lowercase letters and digits, a letter first."""
_QUANTITY = r"^\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
"""A Kubernetes resource quantity (`16`, `500m`, `128Gi`)."""


class SlurmLaunchConfig(Section):
    """`launch.launcher: slurm`: one `sbatch` allocation (Monarch's SlurmJob) with a node set per
    host mesh."""

    partition: str | None = None
    """Partition (`#SBATCH --partition`); None = the cluster's default."""

    account: str | None = None
    """Account charged (`#SBATCH --account`); None = the user's default."""

    qos: str | None = None
    """Quality of service (`#SBATCH --qos`); None = the cluster's default."""

    time_limit: str | None = Field(None, pattern=r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
    """Wall-clock limit as `HH:MM:SS` or `D-HH:MM:SS`; None = the partition's default."""

    gpus_per_node: int | None = Field(None, ge=0)
    """GPUs requested per node (`--gpus-per-node`); also the GPUs each host offers to placement.
    None = request none."""

    cpus_per_task: int | None = Field(None, ge=1)
    """CPUs per node's worker task (`--cpus-per-task`); None = the cluster's default."""

    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$")
    """Memory per node (`--mem`, e.g. `64G`); None = the cluster's default."""

    exclusive: bool = True
    """Request whole nodes (`--exclusive`)."""

    python_exe: str | None = None
    """Interpreter the worker loop runs under on the nodes; None = this controller's interpreter
    (a shared filesystem is assumed)."""

    port: int = Field(22222, ge=1024, le=65535)
    """TCP port of each node's Monarch worker loop."""

    job_start_timeout_s: int | None = Field(None, gt=0)
    """Give up when the allocation has not started after this long (queueing); None = wait."""

    log_dir: str | None = None
    """Directory of the batch job's stdout/stderr files; None = `<run dir>/slurm`."""

    extra_args: list[str] = []
    """More `#SBATCH` options, verbatim, each starting with `-` (e.g. `--constraint=h100`). Not
    `--export`: the launcher sets it (the worker environment is `launch.env`)."""

    controller_address: str | None = Field(None, pattern=r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}$")
    """Address this controller's Monarch runtime listens on for the nodes, as `tcp://IP:0` (an
    interface the nodes reach; port 0 = any free port). None = this machine's hostname, which must
    then resolve to an address other than loopback (a login node whose hostname names the wrong
    network, or only 127.0.x.x, needs this)."""

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, value: list[str]) -> list[str]:
        for arg in value:
            if not arg.startswith("-"):
                raise ValueError(f"{arg!r}: an sbatch option starting with '-' (e.g. --constraint=h100)")
            if arg.split("=", 1)[0] == "--export":
                raise ValueError(f"{arg!r}: the launcher sets --export; name the variables in launch.env")
        return value


class K8sLaunchConfig(Section):
    """`launch.launcher: k8s`: pods running Monarch's worker loop (Monarch's KubernetesJob), either
    created here as MonarchMesh resources (provision) or found by label (attach)."""

    mode: Literal["provision", "attach"] = "provision"
    """`provision`: create one MonarchMesh resource per host mesh, named after it (needs the Monarch
    operator; an existing MonarchMesh of that name is patched, so concurrent runs need distinct
    namespaces or host mesh names); `attach`: use running pods selected by `label_selectors`."""

    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace of the pods and MonarchMesh resources."""

    image: str | None = None
    """Container image with meshrl installed (provision mode; required there)."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Provision mode: when the kubelet pulls `image`; None = Kubernetes' default (`Always` for a
    `:latest` tag, else `IfNotPresent`)."""

    cpu: str | None = None
    """CPU request and limit per pod (e.g. `16`, `500m`); None = none set."""

    memory: str | None = None
    """Memory request and limit per pod (e.g. `128Gi`); None = none set."""

    gpus_per_pod: int = Field(0, ge=0)
    """`nvidia.com/gpu` request and limit per pod; also the GPUs each host offers to placement."""

    shared_memory: str | None = "16Gi"
    """Size of the memory-backed /dev/shm volume (the same-host weight transport and NCCL use it);
    None = the container runtime's default."""

    port: int = Field(26600, ge=1024, le=65535)
    """Provision mode: port of each pod's Monarch worker loop (attach mode reads it from each pod's
    MONARCH_PORT variable, 26600 when unset)."""

    secret_env: dict[str, str] = {}
    """Provision mode: worker environment variables taken from Kubernetes Secrets, `NAME:
    secret/key` (e.g. `OPENAI_API_KEY: teacher-api/key`), so their values stay out of the
    MonarchMesh resource; such a name is not copied from the controller (`launch.env`)."""

    label_selectors: dict[str, str] = {}
    """Attach mode: a label selector per host mesh (e.g. `meshrl/host-mesh=learners`)."""

    rank_label: str = Field("apps.kubernetes.io/pod-index", min_length=1)
    """Attach mode: the pod label holding each pod's rank 0..n-1 in its host mesh (a StatefulSet
    sets `apps.kubernetes.io/pod-index`; Volcano `volcano.sh/task-index`)."""

    kubeconfig: str | None = None
    """Path to a kubeconfig for a controller outside the cluster (Monarch then reaches the pods
    through a `kubectl port-forward`); None = in-cluster configuration (the controller runs in a
    pod whose service account may manage MonarchMesh resources and watch pods)."""

    node_selector: dict[str, str] = {}
    """Provision mode: node labels every pod must match (e.g. a GPU type)."""

    timeout_s: int | None = Field(None, gt=0)
    """Deadline for each host mesh's pods to be ready; None = wait indefinitely (Monarch's
    default)."""

    @field_validator("cpu", "memory", "shared_memory", mode="before")
    @classmethod
    def _quantity(cls, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # YAML reads `cpu: 16` as a number
        if value is not None and not (isinstance(value, str) and re.match(_QUANTITY, value)):
            raise ValueError("a Kubernetes quantity such as 16, 500m or 128Gi")
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, ref in value.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{name!r}: an environment variable name")
            if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-._a-zA-Z0-9]+$", ref):
                raise ValueError(f"{name} = {ref!r}: 'secret/key' (a Secret of the namespace and one of its keys)")
        return value


class LaunchConfig(Section):
    """Which launcher provides the hosts and how actor meshes map onto host meshes. The rest of a
    config (meshes, placement, training) is the same for every launcher."""

    launcher: Literal["local", "process", "slurm", "k8s"] = "local"
    """`local`: every host mesh is this machine; `process`: each host is a local worker process
    (Monarch's ProcessJob: a real multi-host job on one machine); `slurm`: nodes of one SLURM
    allocation; `k8s`: Kubernetes pods."""

    hosts: dict[str, int] = {"main": 1}
    """Host meshes: name -> number of hosts. Each actor mesh runs its `meshes.<mesh>.procs`
    processes on every host of its host mesh. The local launcher has one host: every count must be 1."""

    place: dict[str, str] = {}
    """Actor mesh -> host mesh (e.g. `{learner: trainers, generator: samplers}`); an actor mesh not
    listed goes to the first host mesh of `hosts`."""

    run_id: str | None = Field(None, pattern=_NAME)
    """Names the job (SLURM job name, Kubernetes labels, worker environment MESHRL_RUN_ID, log
    prefixes); None = the run directory's name."""

    env: list[str] = ["HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MESHRL_MODELS_DIR"]
    """Names of controller environment variables copied to every host worker when set (e.g. the
    variable holding a teacher API key)."""

    host_loss_timeout_s: float = Field(60.0, gt=0)
    """A host that sends no process status for this long is lost: its calls fail and its meshes are
    replaced (Monarch's HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE, set from this over any value in
    the environment)."""

    on_host_loss: Literal["survivors", "fail"] = "survivors"
    """`survivors`: a mesh that lost a host is respawned on the surviving hosts of its host mesh
    (fewer processes), within `faults.max_restarts`; `fail`: the run stops naming the lost host."""

    forward_logs: bool = True
    """Stream remote processes' output to the controller, each line prefixed with its host and
    rank (launchers other than `local`, whose processes already share the controller's terminal)."""

    slurm: SlurmLaunchConfig = SlurmLaunchConfig()
    """SLURM settings."""

    k8s: K8sLaunchConfig = K8sLaunchConfig()
    """Kubernetes settings."""

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: dict[str, int]) -> dict[str, int]:
        if not value:
            raise ValueError("at least one host mesh")
        for name, count in value.items():
            if not re.match(_NAME, name):
                raise ValueError(f"host mesh name {name!r}: lowercase letters, digits, '-' and '_'")
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} = {count!r}: a host count >= 1")
        return value

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        for mesh, group in self.place.items():
            if mesh not in RUN_MESHES:
                raise ValueError(f"place.{mesh}: not an actor mesh of a run {list(RUN_MESHES)} (meshes of your own "
                                 "take their host mesh where you declare them)")
            if group not in self.hosts:
                raise ValueError(f"place.{mesh} = {group!r}: not a host mesh of launch.hosts {sorted(self.hosts)}")
        if self.launcher == "local":
            for name, count in self.hosts.items():
                if count != 1:
                    raise ValueError(f"hosts.{name} = {count}: the local launcher has one host (use "
                                     "launch.launcher=process for several hosts on this machine)")
        if self.launcher == "k8s":
            for name in self.hosts:
                if not re.match(_K8S_MESH_NAME, name):
                    raise ValueError(f"hosts.{name}: Kubernetes host mesh names are lowercase letters and digits, "
                                     "starting with a letter (they name MonarchMesh resources)")
            unknown = sorted(set(self.k8s.label_selectors) - set(self.hosts))
            if unknown:
                raise ValueError(f"k8s.label_selectors.{unknown[0]}: not a host mesh of launch.hosts {sorted(self.hosts)}")
        if self.launcher == "k8s" and self.k8s.mode == "attach":
            missing = sorted(set(self.hosts) - set(self.k8s.label_selectors))
            if missing:
                raise ValueError(f"k8s.label_selectors: attach mode needs a selector for host mesh {missing[0]!r}")
        if self.launcher == "k8s" and self.k8s.mode == "provision" and not self.k8s.image:
            raise ValueError("k8s.image: provision mode needs a container image with meshrl installed")
        return self

    def host_mesh_of(self, mesh: str) -> str:
        """The host mesh actor mesh ``mesh`` runs on."""
        return self.place.get(mesh, next(iter(self.hosts)))
