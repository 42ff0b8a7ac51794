"""benchmarks/ablation.py's result file: a run of some arms keeps the runs recorded earlier with the
same settings (each with its own provenance), and --resume takes recorded runs instead of rerunning."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_ablation", ROOT / "benchmarks" / "ablation.py")
ablation = sys.modules["bench_ablation"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)

import benchmarks.common as common  # noqa: E402 (the repository root is on sys.path above)


def _run(arm: str, task: str, seed: int, step_s: float, commit: str) -> dict:
    return {"arm": arm, "task": task, "seed": seed, "wall_s": 60.0, "mean_step_s": step_s,
            "eval_accuracy": {"0": 0.1, "3": 0.2}, "commit": commit, "date": "2030-01-01"}


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": 6, "eval_every": 3, "eval_size": 100, "code_eval_size": 20, **kw})


def test_a_partial_rerun_replaces_its_runs_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(ablation, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    earlier = {"steps": 6, "eval_every": 3, "eval_size": 100, "code_eval_size": 20,
               "runs": [_run("baseline", "arithmetic", 0, 10.0, "old"), _run("baseline", "code", 0, 30.0, "old"),
                        _run("sdpo", "code", 0, 45.0, "old")]}
    (tmp_path / "ablation.json").write_text(json.dumps(earlier))
    recorded = ablation.recorded_runs(_args())
    assert set(recorded) == {("baseline", "arithmetic", 0), ("baseline", "code", 0), ("sdpo", "code", 0)}

    plan = [("baseline", "arithmetic", 0), ("sdpo", "arithmetic", 0)]
    fresh = _run("baseline", "arithmetic", 0, 20.0, "new")
    ablation.record(plan, {("baseline", "arithmetic", 0): fresh}, recorded, _args())

    written = json.loads((tmp_path / "ablation.json").read_text())
    runs = {(r["arm"], r["task"], r["seed"]): r for r in written["runs"]}
    assert runs[("baseline", "arithmetic", 0)]["commit"] == "new"  # replaced by this run's
    assert runs[("sdpo", "code", 0)]["commit"] == "old"  # kept, with its own provenance
    assert runs[("sdpo", "code", 0)]["step_time_vs_baseline"] == 1.5  # paired with its own seed's baseline
    assert written["tasks"] == ["arithmetic", "code"] and written["seeds"] == {"arithmetic": [0], "code": [0]}
    assert written["missing"] == ["ablation-sdpo-arithmetic-s0"]
    assert (tmp_path / "ablation.png").stat().st_size > 0


def test_runs_recorded_with_other_settings_are_not_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ablation, "RESULTS", tmp_path)
    (tmp_path / "ablation.json").write_text(json.dumps(
        {"steps": 16, "eval_every": 8, "eval_size": 200, "code_eval_size": 40,
         "runs": [_run("baseline", "arithmetic", 0, 10.0, "old")]}))
    assert ablation.recorded_runs(_args()) == {}
    assert "written with other settings" in capsys.readouterr().out
    assert set(ablation.recorded_runs(_args(steps=16, eval_every=8, eval_size=200, code_eval_size=40))) == \
        {("baseline", "arithmetic", 0)}
