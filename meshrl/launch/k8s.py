"""`launch.launcher: k8s`: host meshes of Kubernetes pods running Monarch's worker loop (Monarch's
KubernetesJob).

`provision` mode creates one MonarchMesh resource per host mesh; the Monarch operator
(monarch-operator 0.2.x for Monarch 0.7) turns each into a StatefulSet of `launch.hosts[name]` pods
behind a headless Service. Their pod template is Monarch's worker template (its bootstrap running
`run_worker_loop_forever`, resources, memory-backed /dev/shm) plus meshrl's labels, worker
environment, container port and node selector. `attach` mode uses pods that are already running the
worker loop (e.g. launch/k8s/workers-statefulset.yaml), found by label selector and ordered by a
rank label; they outlive the run.

`dry_run` renders the MonarchMesh manifests that provisioning would create, with no cluster.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml

from meshrl.launch.base import Launcher, LaunchError

log = logging.getLogger("meshrl")

GPU_RESOURCE = "nvidia.com/gpu"


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value: at most 63 of [A-Za-z0-9-_.], alphanumeric at both
    ends (other characters become '-')."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


class _ManifestDumper(yaml.SafeDumper):
    """YAML with multi-line strings (the worker bootstrap script) as literal blocks."""


_ManifestDumper.add_representer(
    str, lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


class K8sLauncher(Launcher):
    """One MonarchMesh (provision) or one label selector (attach) per host mesh of `launch.hosts`."""

    kind = "k8s"

    def labels(self, host_mesh: str) -> dict[str, str]:
        """Labels of a host mesh's pods and of its MonarchMesh resource."""
        return {"app": "meshrl", "meshrl/run-id": label_value(self.run_id), "meshrl/host-mesh": host_mesh}

    def pod_template(self, host_mesh: str):
        """The `V1PodTemplateSpec` of a provisioned host mesh's pods: Monarch's worker template for
        `launch.k8s` (image, cpu/memory/GPU requests = limits, /dev/shm, MONARCH_PORT) with this
        run's labels, worker environment, container port, pull policy and node selector."""
        from kubernetes import client
        from monarch._src.job.service_identity import SERVICE_PROC_IDS_ENV
        from monarch.job.kubernetes import ImageSpec, KubernetesJob

        k = self.cfg.k8s
        resources = {"cpu": k.cpu, "memory": k.memory, GPU_RESOURCE: k.gpus_per_pod or None}
        image = ImageSpec(k.image, resources={n: v for n, v in resources.items() if v} or None,
                          shared_memory_size=k.shared_memory)
        template = KubernetesJob._build_worker_pod_template(image, k.port, [])
        container = template.spec.containers[0]
        # Monarch gives per-pod service identities only to meshes it templates itself (image_spec);
        # a pod_template mesh is dialled by address, so its pods get no identity list and the
        # bootstrap serves the plain address.
        container.env = [e for e in container.env if e.name != SERVICE_PROC_IDS_ENV] + self._env_vars()
        container.ports = [client.V1ContainerPort(name="monarch", container_port=k.port, protocol="TCP")]
        container.image_pull_policy = k.image_pull_policy
        template.metadata = client.V1ObjectMeta(labels=self.labels(host_mesh))
        template.spec.node_selector = dict(k.node_selector) or None
        return template

    def _env_vars(self) -> list:
        """`worker_env()` as container variables, with `launch.k8s.secret_env` from Secrets."""
        from kubernetes import client

        secret = self.cfg.k8s.secret_env
        plain = [client.V1EnvVar(name=n, value=v) for n, v in sorted(self.worker_env().items()) if n not in secret]
        refs = [client.V1EnvVar(name=n, value_from=client.V1EnvVarSource(secret_key_ref=client.V1SecretKeySelector(
            name=ref.split("/", 1)[0], key=ref.split("/", 1)[1]))) for n, ref in sorted(secret.items())]
        return plain + refs

    def manifest(self, host_mesh: str) -> dict[str, Any]:
        """The MonarchMesh resource provisioning creates for ``host_mesh``, as the body Monarch's
        `KubernetesJob` sends (its group/version, replicas, port and serialized pod template)."""
        from kubernetes import client
        from monarch._src.job.kubernetes import _MONARCHMESH_GROUP, _MONARCHMESH_VERSION

        k = self.cfg.k8s
        return {
            "apiVersion": f"{_MONARCHMESH_GROUP}/{_MONARCHMESH_VERSION}",
            "kind": "MonarchMesh",
            "metadata": {"name": host_mesh, "namespace": k.namespace, "labels": self.labels(host_mesh)},
            "spec": {"replicas": self.cfg.hosts[host_mesh], "port": k.port,
                     "podTemplate": client.ApiClient().sanitize_for_serialization(self.pod_template(host_mesh))},
        }

    def job(self):
        from monarch.job.kubernetes import KubeConfig, KubernetesJob

        k = self.cfg.k8s
        kubeconfig = None
        if k.kubeconfig is not None:
            if not Path(k.kubeconfig).expanduser().is_file():
                raise LaunchError(f"launch.k8s.kubeconfig = {k.kubeconfig!r}: no such file")
            kubeconfig = KubeConfig.from_path(k.kubeconfig)
        job = KubernetesJob(k.namespace, timeout=k.timeout_s, kubeconfig=kubeconfig)
        for name, count in self.cfg.hosts.items():
            if k.mode == "attach":
                job.add_mesh(name, count, label_selector=k.label_selectors[name], pod_rank_label=k.rank_label)
            else:
                job.add_mesh(name, count, port=k.port, pod_template=self.pod_template(name), labels=self.labels(name))
        return job

    def stop(self) -> None:
        """Provision mode: delete the MonarchMesh resources (the operator removes their pods).
        Attach mode: release Monarch's port-forward and leave the pods running (they are not ours;
        Monarch's kill says so with NotImplementedError once it has released what it holds)."""
        if self.cfg.k8s.mode == "provision":
            super().stop()
            return
        job, self._job = self._job, None
        self.restore_log_forwarding()
        if job is None:
            return
        try:
            job.kill()
        except NotImplementedError:
            log.info("launcher k8s: attached pods keep running (%s)", ", ".join(self.cfg.k8s.label_selectors.values()))
        except Exception as e:  # noqa: BLE001 - shutdown is best effort
            log.warning("launcher k8s: releasing the job failed: %s", e)

    def dry_run(self, out_dir: Path | None = None) -> str:
        """Provision mode: one MonarchMesh manifest per host mesh, written to ``out_dir/<host
        mesh>.yaml`` (None = included in the text); attach mode: the selectors. Nothing contacts a
        cluster."""
        k = self.cfg.k8s
        lines = [f"launcher k8s, {k.mode} mode: run {self.run_id}, namespace {k.namespace}"]
        if k.mode == "attach":
            for name, count in self.cfg.hosts.items():
                lines.append(f"  {name}: {count} running pod(s) selected by '{k.label_selectors[name]}', "
                             f"ranks 0..{count - 1} from label {k.rank_label}")
            lines.append("nothing is created: the pods must run Monarch's worker loop (see "
                         "launch/k8s/workers-statefulset.yaml); their environment is their own (no MESHRL_RUN_ID "
                         "or launch.env)")
            return "\n".join(lines) + "\n"
        shape = ", ".join(f"{n}={v}" for n, v in (("cpu", k.cpu), ("memory", k.memory),
                                                   (GPU_RESOURCE, k.gpus_per_pod or None),
                                                   ("/dev/shm", k.shared_memory)) if v) or "no resources set"
        docs = []
        for name, count in self.cfg.hosts.items():
            text = yaml.dump(self.manifest(name), Dumper=_ManifestDumper, sort_keys=False)
            where = ""
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / f"{name}.yaml").write_text(text)
                where = f" -> {out_dir / f'{name}.yaml'}"
            else:
                docs.append(text)
            lines.append(f"  MonarchMesh {name}: {count} pod(s) of {k.image} ({shape}), port {k.port}{where}")
        env = sorted(set(self.worker_env()) | set(k.secret_env))
        lines.append("worker environment: " + ", ".join(f"{n} (secret {k.secret_env[n]})" if n in k.secret_env else n
                                                      for n in env))
        return "\n".join(lines) + "\n" + "".join("---\n" + d for d in docs)
