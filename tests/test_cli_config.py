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
    ],
)
def test_config_errors_exit_2_with_one_line_naming_the_key(args, needle):
    res = run_cli("train", "--dry-run", *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]


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
