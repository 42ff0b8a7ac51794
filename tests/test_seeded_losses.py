"""scripts/seeded_losses.py's comparison (no runs): it reads its own output and the recorded
before/after files in benchmarks/results, and flags a difference past the tolerance."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("seeded_losses", ROOT / "scripts" / "seeded_losses.py")
seeded = sys.modules["seeded_losses"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seeded)

RECORDED = sorted((ROOT / "benchmarks" / "results").glob("*_seeded_losses.json"))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_recorded_files_compare_with_themselves_and_catch_a_change(path, tmp_path):
    arms = seeded.load_arms(path)
    assert arms == json.loads(path.read_text())["after"] and set(arms) == set(seeded.ARMS)
    assert seeded.compare(arms, seeded.load_arms(path), rtol=0.0)
    own = tmp_path / "run.json"  # what `--out` writes reads back the same
    own.write_text(json.dumps(arms))
    assert seeded.load_arms(own) == arms
    moved = copy.deepcopy(arms)
    moved["baseline"][1]["loss/grpo"] *= 1 + 1e-3
    assert seeded.compare(moved, arms, rtol=1e-4) is False
    assert seeded.compare(moved, arms, rtol=1e-2) is True


def test_a_file_of_another_shape_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_relative_difference": 0.0}))
    with pytest.raises(ValueError, match="bad.json: not a seeded-losses file"):
        seeded.load_arms(bad)
