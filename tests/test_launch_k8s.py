"""The Kubernetes launcher without a cluster: the MonarchMesh resources and pod templates it builds
validate against the `kubernetes` client's models and carry the run's placement, resources, port,
/dev/shm, environment and labels; the dry run writes one manifest per host mesh and they are the
bodies Monarch's KubernetesJob sends; attach mode finds the pods of the example StatefulSets. Only
the HTTP layer of the client (`RESTClientObject.request`) is replaced, never Monarch's code or ours."""

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import urllib3
import yaml

pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402
from kubernetes.client import rest  # noqa: E402
from monarch.config import configured  # noqa: E402

from meshrl.config.base import ConfigError, load_config  # noqa: E402
from meshrl.config.run import RunConfig  # noqa: E402
from meshrl.launch import make_launcher  # noqa: E402
from meshrl.launch.k8s import label_value  # noqa: E402
from meshrl.meshes.placement import plan_run  # noqa: E402
from meshrl.testing.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch" / "k8s"
K8S = ["launch.launcher=k8s", "launch.k8s.image=registry.example/meshrl:0.1", "launch.hosts={learners: 1, generators: 2}"]


def launcher(*overrides, run_id="run1", path=None):
    cfg = load_config(RunConfig, path, ([] if path else K8S) + list(overrides))
    return make_launcher(cfg.launch, run_id)


def roundtrip(data: dict, model: str) -> dict:
    """``data`` deserialized into the client's model ``model`` and serialized again (a field the
    model does not know, or a value of the wrong type, does not survive)."""
    api = client.ApiClient()
    obj = api.deserialize(json.dumps(data), model, "application/json")
    assert type(obj).__name__ == model
    return api.sanitize_for_serialization(obj)


def container(manifest: dict) -> dict:
    (c,) = manifest["spec"]["podTemplate"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.fixture
def kubeconfig(tmp_path):
    """A kubeconfig for a cluster that does not exist (it is only parsed)."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": "https://k8s.invalid:6443"}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path


@pytest.fixture
def api_server(monkeypatch):
    """Replace the client's HTTP layer: record each request and answer with ``respond(method,
    url)`` -> (status, body bytes)."""
    calls, answers = [], {}

    def request(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        calls.append((method, url.split("?")[0], json.loads(json.dumps(body)) if body is not None else None))
        status, data = answers.get(method, (201, b"{}"))
        return rest.RESTResponse(urllib3.HTTPResponse(body=io.BytesIO(data), status=status, preload_content=False,
                                                      headers={"Content-Type": "application/json"}))

    monkeypatch.setattr(rest.RESTClientObject, "request", request)
    return calls, answers


def test_manifests_validate_against_the_client_models():
    k8s = launcher("launch.k8s.cpu=16", "launch.k8s.memory=128Gi", "launch.k8s.gpus_per_pod=4",
                   "launch.k8s.node_selector={gpu: h100}", "launch.k8s.image_pull_policy=Always",
                   "launch.k8s.secret_env={OPENAI_API_KEY: teacher-api/key}")
    for name in ("learners", "generators"):
        manifest = k8s.manifest(name)
        template = manifest["spec"]["podTemplate"]
        assert roundtrip(template, "V1PodTemplateSpec") == template
        assert roundtrip(manifest["metadata"], "V1ObjectMeta") == manifest["metadata"]
        assert manifest["apiVersion"] == "monarch.pytorch.org/v1alpha1" and manifest["kind"] == "MonarchMesh"


def test_placement_resources_port_and_shared_memory():
    k8s = launcher("launch.k8s.cpu=16", "launch.k8s.memory=128Gi", "launch.k8s.gpus_per_pod=4",
                   "launch.k8s.port=27000", "launch.k8s.shared_memory=32Gi", "launch.k8s.namespace=rl")
    assert {n: k8s.manifest(n)["spec"]["replicas"] for n in ("learners", "generators")} == {"learners": 1, "generators": 2}
    manifest = k8s.manifest("generators")
    assert manifest["metadata"]["name"] == "generators" and manifest["metadata"]["namespace"] == "rl"
    c = container(manifest)
    assert c["image"] == "registry.example/meshrl:0.1"
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "4"}
    assert manifest["spec"]["port"] == 27000 and env_of(c)["MONARCH_PORT"] == "27000"
    assert c["ports"] == [{"name": "monarch", "containerPort": 27000, "protocol": "TCP"}]
    assert c["volumeMounts"] == [{"name": "dev-shm", "mountPath": "/dev/shm"}]
    assert manifest["spec"]["podTemplate"]["spec"]["volumes"] == [
        {"name": "dev-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}]
    assert "run_worker_loop_forever" in c["command"][-1]


def test_no_gpus_no_resources_and_no_shared_memory_are_left_out():
    c = container(launcher("launch.k8s.shared_memory=null").manifest("learners"))
    assert "resources" not in c and "volumeMounts" not in c
    c = container(launcher("launch.k8s.memory=8Gi").manifest("learners"))
    assert c["resources"]["limits"] == {"memory": "8Gi"}


def test_worker_environment_labels_and_node_selector(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/models/hf")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-in-the-manifest")
    monkeypatch.delenv("MESHRL_MODELS_DIR", raising=False)
    k8s = launcher("launch.env=[HF_HOME, MESHRL_MODELS_DIR, OPENAI_API_KEY]", "launch.k8s.node_selector={gpu: h100}",
                   "launch.k8s.secret_env={OPENAI_API_KEY: teacher-api/key}", "launch.k8s.image_pull_policy=IfNotPresent",
                   run_id="Run_7:a")
    manifest = k8s.manifest("learners")
    c = container(manifest)
    env = env_of(c)
    assert env["MESHRL_RUN_ID"] == "Run_7:a" and env["HF_HOME"] == "/models/hf" and "MESHRL_MODELS_DIR" not in env
    assert env["OPENAI_API_KEY"] == {"secretKeyRef": {"name": "teacher-api", "key": "key"}}
    assert "sk-not-in-the-manifest" not in json.dumps(manifest)
    assert "MONARCH_SERVICE_PROC_IDS" not in env  # pod_template meshes are dialled by address
    labels = {"app": "meshrl", "meshrl/run-id": "Run_7-a", "meshrl/host-mesh": "learners"}
    assert manifest["metadata"]["labels"] == manifest["spec"]["podTemplate"]["metadata"]["labels"] == labels
    assert manifest["spec"]["podTemplate"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert c["imagePullPolicy"] == "IfNotPresent"


def test_label_value():
    assert label_value("run1") == "run1"
    assert label_value("_2024-01-01 12:00_") == "2024-01-01-12-00"
    assert len(label_value("a" * 80)) == 63


def test_dry_run_writes_one_manifest_per_host_mesh_and_contacts_no_cluster(tmp_path, api_server):
    calls, _ = api_server
    k8s = launcher("launch.k8s.gpus_per_pod=4")
    text = k8s.dry_run(tmp_path / "manifests")
    files = sorted(p.name for p in (tmp_path / "manifests").iterdir())
    assert files == ["generators.yaml", "learners.yaml"]
    for name in ("learners", "generators"):
        assert yaml.safe_load((tmp_path / "manifests" / f"{name}.yaml").read_text()) == k8s.manifest(name)
        assert f"MonarchMesh {name}:" in text
    assert "MESHRL_RUN_ID" in text and "---" not in text
    printed = k8s.dry_run(None)
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(printed.split("---\n", 1)[1])] == ["learners", "generators"]
    assert calls == []


def test_dry_run_manifests_are_what_monarch_sends(kubeconfig, api_server):
    """KubernetesJob.apply() (Monarch's _create) with our job: the bodies it POSTs are the dry run's."""
    calls, _ = api_server
    k8s = launcher("launch.k8s.gpus_per_pod=4", "launch.k8s.cpu=8", f"launch.k8s.kubeconfig={kubeconfig}",
                   "launch.k8s.namespace=rl")
    with configured():  # KubernetesJob() sets the process-wide default transport
        job = k8s.job()
        job.apply()
    assert [(m, u) for m, u, _ in calls] == [("POST", "https://k8s.invalid:6443/apis/monarch.pytorch.org/v1alpha1/namespaces/rl/monarchmeshes")] * 2
    assert [body for _, _, body in calls] == [k8s.manifest("learners"), k8s.manifest("generators")]


def test_kill_deletes_the_monarch_meshes(kubeconfig, api_server):
    calls, _ = api_server
    k8s = launcher(f"launch.k8s.kubeconfig={kubeconfig}")
    with configured():
        k8s._job = k8s.job()
        k8s._job.apply()
        calls.clear()
        k8s.stop()
    assert [(m, u.rsplit("/", 1)[1]) for m, u, _ in calls] == [("DELETE", "learners"), ("DELETE", "generators")]


def _example_pods(mesh: str, port: str) -> list[dict]:
    """The pods the example StatefulSet of ``mesh`` would run, as the API server reports them."""
    (sts,) = [d for d in yaml.safe_load_all((EXAMPLE / "workers-statefulset.yaml").read_text())
              if d["kind"] == "StatefulSet" and d["metadata"]["name"] == mesh]
    pods = []
    for rank in reversed(range(sts["spec"]["replicas"])):
        template = json.loads(json.dumps(sts["spec"]["template"]))
        template["metadata"]["labels"]["apps.kubernetes.io/pod-index"] = str(rank)
        for e in template["spec"]["containers"][0]["env"]:
            if e["name"] == "MONARCH_PORT":
                e["value"] = port
        pods.append({"metadata": {"name": f"{mesh}-{rank}", **template["metadata"]}, "spec": template["spec"],
                     "status": {"podIP": f"10.0.0.{rank + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})
    return pods


def test_attach_mode_job_finds_the_example_statefulset_pods(kubeconfig, api_server):
    """The gpu-cluster example in attach mode: Monarch's KubernetesJob holds one selector mesh per
    host mesh, and its pod watch (over the client's models) finds the example StatefulSet's pods."""
    calls, answers = api_server
    k8s = launcher("launch.k8s.mode=attach", f"launch.k8s.kubeconfig={kubeconfig}", path=EXAMPLE / "gpu-cluster.yaml")
    selectors = k8s.cfg.k8s.label_selectors
    with configured():
        job = k8s.job()
    assert {n: (m["label_selector"], m["num_replicas"], m["pod_rank_label"], m["provisioned"])
            for n, m in job._meshes.items()} == {
        "learners": (selectors["learners"], 1, "apps.kubernetes.io/pod-index", False),
        "generators": (selectors["generators"], 2, "apps.kubernetes.io/pod-index", False)}
    pods = _example_pods("generators", "26601")
    for pod in pods:  # the selector matches the example's pod labels
        assert dict(kv.split("=") for kv in selectors["generators"].split(",")).items() <= pod["metadata"]["labels"].items()
    answers["GET"] = (200, b"".join(json.dumps({"type": "ADDED", "object": p}).encode() + b"\n" for p in pods))
    mesh = job._meshes["generators"]
    found = job._wait_for_ready_pods(mesh["label_selector"], mesh["num_replicas"], mesh["pod_rank_label"], timeout=5)
    assert [(p.name, p.ip, p.port) for p in found] == [("generators-0", "10.0.0.1", 26601), ("generators-1", "10.0.0.2", 26601)]
    assert calls[0][:2] == ("GET", "https://k8s.invalid:6443/api/v1/namespaces/meshrl/pods")


def test_attach_mode_stop_leaves_the_pods(caplog):
    k8s = launcher("launch.k8s.mode=attach", "launch.k8s.label_selectors={learners: a=1, generators: a=2}")
    with configured():
        k8s._job = k8s.job()
        k8s._job.apply()  # attach-only meshes: nothing to create, no cluster contacted
        k8s.stop()
    assert k8s._job is None and not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "attach mode" in k8s.dry_run(None) and "a=2" in k8s.dry_run(None)


def test_example_statefulsets_match_the_example_config():
    config = load_config(RunConfig, EXAMPLE / "gpu-cluster.yaml")
    docs = list(yaml.safe_load_all((EXAMPLE / "workers-statefulset.yaml").read_text()))
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert set(sets) == set(services) == set(config.launch.hosts)
    for name, sts in sets.items():
        assert services[name]["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        assert sts["spec"]["replicas"] == config.launch.hosts[name] and sts["spec"]["serviceName"] == name
        assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert "run_worker_loop_forever" in c["command"][-1]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(config.launch.k8s.gpus_per_pod)


def test_example_manifests_validate_against_the_client_models():
    models = {"Service": "V1Service", "StatefulSet": "V1StatefulSet", "ServiceAccount": "V1ServiceAccount",
              "Role": "V1Role", "RoleBinding": "V1RoleBinding", "Pod": "V1Pod"}
    for path in (EXAMPLE / "workers-statefulset.yaml", EXAMPLE / "controller.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert roundtrip(doc, models[doc["kind"]]) == doc, (path.name, doc["kind"])
    role = next(d for d in yaml.safe_load_all((EXAMPLE / "controller.yaml").read_text()) if d["kind"] == "Role")
    rules = {r["resources"][0]: set(r["verbs"]) for r in role["rules"]}
    assert {"create", "patch", "delete"} <= rules["monarchmeshes"] and {"list", "watch"} <= rules["pods"]


def test_example_config_places_learner_and_generators():
    config = load_config(RunConfig, EXAMPLE / "gpu-cluster.yaml")
    assert config.launch.hosts == {"learners": 1, "generators": 2}
    rows = plan_run(config).rows
    assert {(r.host, r.devices) for r in rows if r.mesh == "learner"} == {("learners x1", (i,)) for i in range(4)}
    assert {(r.host, r.devices) for r in rows if r.mesh == "generator"} == {("generators x2", (i,)) for i in range(4)}
    assert {(r.host, r.devices) for r in rows if r.mesh == "rewarder"} == {("learners x1", ())}


@pytest.mark.parametrize("override, key", [
    ("launch.k8s.memory=64GB", "launch.k8s.memory"),
    ("launch.k8s.cpu=lots", "launch.k8s.cpu"),
    ("launch.k8s.secret_env={KEY: no-key}", "launch.k8s.secret_env"),
    ("launch.k8s.image_pull_policy=Sometimes", "launch.k8s.image_pull_policy"),
    ("launch.hosts={gen_hosts: 1}", "hosts.gen_hosts"),
    ("launch.k8s.label_selectors={nosuch: a=b}", "k8s.label_selectors.nosuch"),
    ("launch.k8s.mode=attach", "k8s.label_selectors"),
])
def test_a_bad_k8s_value_is_a_one_line_config_error(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, K8S + [override])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_a_missing_kubeconfig_is_a_one_line_launch_error(tmp_path):
    from meshrl.launch import LaunchError

    with pytest.raises(LaunchError, match=r"^launch.k8s.kubeconfig = .*: no such file$"):
        launcher(f"launch.k8s.kubeconfig={tmp_path / 'nope'}").job()


@pytest.mark.monarch
def test_the_example_worker_command_serves_monarch(tmp_path):
    """The StatefulSet's worker script, run here as a process with its container environment,
    takes a Monarch client's actors (which see that environment)."""
    sts = next(d for d in yaml.safe_load_all((EXAMPLE / "workers-statefulset.yaml").read_text()) if d["kind"] == "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["python", "-u", "-c"]
    script = textwrap.dedent("""
        import os, signal, subprocess, sys
        from monarch.actor import Actor, endpoint
        from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
        from monarch._src.actor.bootstrap import attach_to_workers
        from monarch.config import configure
        configure(default_transport=ChannelTransport.TcpWithLocalhost)  # this machine's hostname is loopback-only
        worker = subprocess.Popen([sys.executable, "-u", "-c", sys.argv[1]], env={**os.environ, **dict(zip(sys.argv[2::2], sys.argv[3::2]))},
                                  start_new_session=True)  # its actor processes join its session
        class Probe(Actor):
            @endpoint
            def env(self):
                return os.environ.get("HF_HUB_OFFLINE"), os.environ.get("MONARCH_PORT")
        try:
            hosts = attach_to_workers(name="learners", ca="trust_all_connections", workers=[f"tcp://127.0.0.1:{os.environ['MONARCH_PORT']}"])
            probe = hosts.spawn_procs(per_host={"procs": 1}).spawn("probe", Probe)
            print("ENV", list(probe.env.call().get().values()))
            hosts.shutdown().get()
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
    """)
    port = str(free_port())
    env = {e["name"]: e["value"] for e in c["env"]} | {"MONARCH_PORT": port, "HF_HUB_OFFLINE": "example"}
    out = subprocess.run([sys.executable, "-c", script, c["command"][3], *[x for kv in env.items() for x in kv]],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "MONARCH_PORT": port})
    assert f"ENV [('example', '{port}')]" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
