"""One config file, four launchers: only the `launch:` section changes. Runs it for real on this
machine (`meshrl train`) and as a 2-host process job (`meshrl launch process`), and dry-runs it for
SLURM (the batch script) and Kubernetes (the manifests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_RUN

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

TWO_HOSTS = ["launch.hosts={trainer: 1, sampler: 1}", "launch.place={generator: sampler}"]


def _cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "meshrl.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})},
                          timeout=600)


def _train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in records if r["kind"] == "train"]


def test_the_same_config_runs_locally_on_two_hosts_and_dry_runs_on_slurm_and_kubernetes(tmp_path):
    config = tmp_path / "run.yaml"
    data: dict = {}
    for item in TINY_RUN + ["trainer.steps=2", "trainer.eval.every=0", "trainer.eval.at_start=false",
                            "trainer.checkpoint.export_final=false", f"output.dir={tmp_path / 'runs'}"]:
        key, value = item.split("=", 1)
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    config.write_text(yaml.safe_dump(data))

    local = _cli("train", "-c", str(config), "output.name=local", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-2000:]
    assert [r["version"] for r in _train_records(tmp_path / "runs" / "local")] == [1, 2]

    # the generator's labelled line is transformers' warning about `top_k`, which reaches the root
    # logger (the one the label formats) only where transformers propagates its records: with CI=1
    two = _cli("launch", "process", "-c", str(config), *TWO_HOSTS, "output.name=two-hosts", cwd=tmp_path,
               env={"CI": "1"})
    assert two.returncode == 0, two.stderr[-2000:]
    records = _train_records(tmp_path / "runs" / "two-hosts")
    assert [r["version"] for r in records] == [1, 2]
    assert all(r["sync/transport/rdma"] == 1 for r in records)  # the generator's host is another host
    # every remote line came back through Monarch's log forwarding, labelled with its mesh
    assert "[generator r0]" in two.stdout + two.stderr

    slurm = _cli("launch", "slurm", "-c", str(config), *TWO_HOSTS, "--dry-run", "--out", str(tmp_path / "sbatch"),
                 cwd=tmp_path)
    assert slurm.returncode == 0, slurm.stderr
    script = (tmp_path / "sbatch" / "sbatch.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "run_worker_loop_forever" in script

    k8s = _cli("launch", "k8s", "-c", str(config), *TWO_HOSTS, "launch.k8s.image=registry.example/meshrl:1",
               "--dry-run", "--out", str(tmp_path / "manifests"), cwd=tmp_path)
    assert k8s.returncode == 0, k8s.stderr
    manifests = {p.stem: yaml.safe_load(p.read_text()) for p in (tmp_path / "manifests").glob("*.yaml")}
    assert sorted(manifests) == ["sampler", "trainer"]
    assert all(m["kind"] == "MonarchMesh" and m["spec"]["replicas"] == 1 for m in manifests.values())
