"""The command line and typed config: resolved output, and exit 2 with one line per error class."""

import subprocess
import sys

import pytest
import yaml

from meshrl.cli import config_reference_markdown, default_config_path, main
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_prints_resolved_config_with_overrides():
    res = run_cli("train", "--dry-run", "learner.lr=2e-5", "trainer.steps=3")
    assert res.returncode == 0, res.stderr
    body = yaml.safe_load(res.stdout)
    assert body["learner"]["lr"] == 2e-5
    assert body["trainer"]["steps"] == 3
    assert body["model"]["name_or_path"] == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["learner.lrr=1"], "unknown key 'learner.lrr'"),
        (["learner.lr=abc"], "learner.lr = 'abc'"),
        (["learner.lr=-1"], "learner.lr = -1"),
        (["trainer.steps=0"], "trainer.steps = 0"),
        (["trainer.loss.name=dpo"], "trainer.loss.name = 'dpo'"),
        (["meshes.rewarder.colocate_with=nowhere"], "rewarder.colocate_with = 'nowhere'"),
        (["-c", "configs/does-not-exist.yaml"], "config file not found: configs/does-not-exist.yaml"),
        (["learner"], "override 'learner': expected key.path=value"),
        (["weight_sync.keep_versions=3"], "weight_sync: keep_versions 3 must be below max_arenas 3"),
        (["meshes.generator.procs=2", "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[0]"],
         "meshes.generator.devices = [0] (list): expected procs * gpus_per_proc = 2 * 1 = 2 GPU indices, got 1"),
        (["--host-gpus", "2", "meshes.learner.gpus_per_proc=1", "meshes.learner.devices=[1]",
          "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[1]"],
         "meshes.generator.devices = [1]: GPU 1 is already meshes.learner's"),
        (["--host-gpus", "2", "meshes.learner.procs=3", "meshes.learner.gpus_per_proc=1"],
         "meshes.learner.gpus_per_proc = 1: 3 process(es) need 3 GPU(s) but only 2 of the host's 2 are free"),
        (["generator.lora_slots=2", "generator.backend=hf"], "generator.lora_slots > 0 needs generator.backend = 'vllm'"),
        (["generator.lora_slots=2"], "generator.lora_slots > 0 needs learner.lora.enabled = true"),
        (["-c", "configs/serve.yaml", "generator.lora_slots=2", "generator.lora_max_rank=32"],
         "serve.limits.max_lora_rank = 128 is over generator.lora_max_rank = 32"),
        (["generator.lora_max_rank=12"], "generator.lora_max_rank = 12"),
        (["generator.lora_slots=2", "learner.lora.enabled=true", "learner.lora.sync=adapter"],
         "generator.lora_slots = 2 is for the API's generators"),
    ],
)
def test_config_errors_exit_2_with_one_line_naming_the_key(args, needle, capsys):
    assert main(["train", "--dry-run", *args]) == 2  # in process: the CLI's own exit code and stderr
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]


@pytest.mark.slow  # ~7 s on 2 cores
def test_dry_run_and_plan_print_the_placement_of_the_multi_gpu_example():
    res = run_cli("train", "--dry-run", "-c", "configs/multi-gpu.yaml", "--host-gpus", "8")
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["meshes"]["learner"]["procs"] == 4  # the table is comments: still YAML
    table = [line.split() for line in res.stdout.splitlines() if line.startswith("# ")]
    assert table[1] == ["#", "placement", "on", "a", "host", "with", "8", "GPUs", "(--host-gpus)"]
    assert table[2] == ["#", "mesh", "proc", "host", "devices", "shares"]
    *placed, launcher = table[3:]
    assert launcher == ["#", "launcher", "local:", "host", "meshes", "main", "x1"]
    rows = [(mesh, int(proc), devices, shares) for _, mesh, proc, _host, devices, shares in placed]
    assert rows == ([("learner", r, str(r), "-") for r in range(4)] + [("generator", r, str(4 + r), "-") for r in range(4)]
                    + [("rewarder", 0, "cpu", "-")])

    plan = run_cli("plan", "-c", "configs/multi-gpu.yaml", "--host-gpus", "8", "meshes.generator.devices=[7,6,5,4]")
    assert plan.returncode == 0, plan.stderr
    assert [line.split()[3] for line in plan.stdout.splitlines()[2:]] == ["0", "1", "2", "3", "7", "6", "5", "4", "cpu"]
    short = run_cli("plan", "-c", "configs/multi-gpu.yaml", "--host-gpus", "7")
    assert short.returncode == 2 and short.stderr.strip() == (
        "meshrl: meshes.generator.gpus_per_proc = 1: 4 process(es) need 4 GPU(s) but only 3 of the host's 7 are free")
    assert run_cli("train", "--host-gpus", "8").returncode == 2  # plans only: never trains on a host it pretends


def test_invalid_yaml_and_wrong_types_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: {lr: [1, 2\n")
    assert main(["train", "--dry-run", "-c", str(bad)]) == 2
    typed = tmp_path / "typed.yaml"
    typed.write_text("learner:\n  micro_batch_size: many\n")
    assert main(["train", "--dry-run", "-c", str(typed)]) == 2
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- a\n- b\n")
    assert main(["train", "--dry-run", "-c", str(scalar)]) == 2


def test_shipped_configs_load_and_default_is_found():
    path = default_config_path()
    assert path is not None and path.name == "default.yaml"
    cfg = load_config(RunConfig, path)
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.task.kind == "arithmetic"
    for yml in sorted(path.parent.glob("*.yaml")):
        load_config(RunConfig, yml)


def test_every_config_field_is_documented():
    text = config_reference_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    undocumented = [r for r in rows if r.rstrip().endswith("|  |") or r.rstrip().endswith("| |")]
    assert not undocumented, undocumented


def test_config_reference_file_is_current():
    from pathlib import Path

    shipped = (Path(__file__).resolve().parent.parent / "configs" / "REFERENCE.md").read_text()
    assert shipped == config_reference_markdown(), "run `meshrl config-reference > configs/REFERENCE.md`"
