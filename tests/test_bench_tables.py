"""benchmarks/tables.py: the README's performance section is rendered from result JSON, in place,
and the committed README matches the committed JSON (so no one types those figures by hand)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
tables = sys.modules["bench_tables"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)

PROVENANCE = {"machine": "x86_64, Test CPU, 2 cores, 8 GiB, no GPU", "date": "2030-01-02", "commit": "abc1234"}
SYNC = {**PROVENANCE, "kind": "sync_vs_async", "steps": 16, "rows": [
    {"max_steps_off_policy": 0, "wall_s": 600.0, "mean_step_s": 10.04,
     "eval": [{"step": 0, "accuracy": 0.065, "elapsed_s": 0.0}, {"step": 16, "accuracy": 0.125, "elapsed_s": 300.0}]},
    {"max_steps_off_policy": 1, "wall_s": 900.0, "mean_step_s": 20.0,
     "eval": [{"step": 0, "accuracy": 0.065, "elapsed_s": 0.0}, {"step": 16, "accuracy": 0.25, "elapsed_s": 500.0}]}]}
GENERATION = {**PROVENANCE, "prompts": 8, "samples_per_prompt": 8, "max_new_tokens": 32, "rounds": 2,
              "rows": [{"backend": "vllm", "tokens_per_s": 300.0, "tokens": 3000, "seconds": 10.0},
                       {"backend": "hf", "tokens_per_s": 100.0, "tokens": 2900, "seconds": 29.0}],
              "ratio_vllm_vs_hf": 3.0}
ABLATION = {**PROVENANCE, "tasks": {"arithmetic": {
    "settings": {"steps": 8, "eval_every": 8, "eval_size": 100}, "left_out": [],
    "arms": {"baseline": {"seeds": [0, 1], "curve": [{"step": 0, "mean": 0.1}, {"step": 8, "mean": 0.3}],
                          "final": {"mean": 0.3, "std": 0.1, "values": [0.2, 0.4]}, "mean_step_s": 10.0},
             "sdpo": {"seeds": [0], "curve": [{"step": 0, "mean": 0.1}, {"step": 8, "mean": 0.5}],
                      "final": {"mean": 0.5, "std": 0.0, "values": [0.5]}, "mean_step_s": 15.0,
                      "diff_final": {"mean": 0.3, "std": 0.0, "values": [0.3]},
                      "equal_wall": {"mean": 0.25, "std": 0.0, "values": [0.25]},
                      "diff_equal_wall": {"mean": 0.05, "std": 0.0, "values": [0.05]},
                      "reach_baseline_final": [{"seed": 0, "steps_frac": 0.5, "train_s_frac": 0.75}],
                      "step_vs_baseline": {"mean": 1.5, "std": 0.0, "values": [1.5]}}}}},
    "runs": [{"run": "baseline-arithmetic-s0", "commit": "abc1234", "date": "2030-01-02", "load_1m_mean": 1.5,
              "faults": []}]}
VS_TRL = {**PROVENANCE, "settings": {"steps": 4}, "arms": {
    "trl": {"step_s_median": 10.0, "parts": {"generate_s": 6.0, "train_s": 4.0}, "tokens_per_s": 100.0,
            "sampled_tokens_per_step": 1000, "trained_tokens_per_step": 1500},
    "meshrl_separate": {"step_s_median": 6.0, "parts": {"generate_s": 3.0, "train_s": 2.5, "sync_s": 0.5},
                        "overhead_share": 0.05, "sync_bytes_per_step": 269e6,
                        "tokens_per_s": 160.0, "sampled_tokens_per_step": 1000, "trained_tokens_per_step": 1500}},
    "ratios": {"meshrl_separate_vs_trl": 0.6},
    "learning": {"trl": [{"step": 4, "elapsed_s": 40.0, "accuracy": 0.1}],
                 "meshrl": [{"step": 4, "elapsed_s": 24.0, "accuracy": 0.15}]}}
README = "# title\n\nprose before, 1.23 s typed by hand\n\n<!-- bench:begin -->\nstale 9.9%\n<!-- bench:end -->\n\nafter\n"


@pytest.fixture
def repo(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, data in (("sync_vs_async", SYNC), ("generation", GENERATION), ("ablation", ABLATION),
                       ("vs_trl", VS_TRL)):
        (results / f"{name}.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return results, readme


def section(readme: Path) -> str:
    text = readme.read_text()
    return text[text.index(tables.BEGIN):text.index(tables.END)]


def test_the_section_has_the_figures_of_the_json(repo):
    results, readme = repo
    assert tables.main(["--results", str(results), "--readme", str(readme)]) == 0
    out = section(readme)
    # default job: accuracy per eval, mean step, wall
    assert "| held-out greedy accuracy, step 16 | 12.5% | 25.0% |" in out
    assert "| mean step | 10.0 s | 20.0 s |" in out
    assert "| whole run (spawn, steps, evals, export) | 600 s (10.0 min) | 900 s (15.0 min) |" in out
    # provenance of each table
    assert ("`python benchmarks/sync_vs_async.py` → `benchmarks/results/sync_vs_async.json`; "
            "x86_64, Test CPU, 2 cores, 8 GiB, no GPU; 2030-01-02, commit abc1234.") in out
    # generation: tokens/s per backend and the ratio
    assert "| vllm | 300.0 | 3000 | 10.00 s |" in out and "| hf | 100.0 | 2900 | 29.00 s |" in out
    assert "vLLM / HF generate: 3.00x tokens/s." in out
    # ablation: per arm accuracy over seeds, the paired difference, equal wall-clock, the target
    assert "| baseline | 2 | 10.0% → 30.0% ± 10.0 | — | — | — | — | 10.0 s | — |" in out
    assert "| sdpo | 1 | 10.0% → 50.0% | +30.0% | 25.0% | +5.0% | 0.50 / 0.75 (meets the target) | 15.0 s | 1.5x |" in out
    assert "`python benchmarks/ablation.py` → `benchmarks/results/ablation.json`" in out
    # vs TRL: step time ratio, parts, goal line, learning
    assert "| step time vs TRL | 1.00x | 0.60x |" in out
    assert "| per step: sync_s | — | 0.50 s |" in out
    assert "| controller overhead (step outside actor compute) | — | 5.0% |" in out
    assert "| weight bytes sent between processes per step | — | 269 MB |" in out
    assert "Goal: meshrl's step time ≤ 0.7x TRL's: meshrl, separate meshes 0.60x (met)." in out
    assert "| 4 | 10.0% at 40 s | 15.0% at 24 s |" in out


def test_a_missing_result_is_one_line_naming_its_script(repo):
    results, readme = repo
    tables.main(["--results", str(results), "--readme", str(readme)])
    out = section(readme)
    assert "### Learner throughput with 1 and 2 data-parallel processes\n\n" \
           "not yet measured: run `python benchmarks/learner_scaling.py`\n" in out
    assert "not yet measured: run `python benchmarks/sync_vs_async.py`" not in out


def test_only_the_text_between_the_markers_is_replaced(repo):
    results, readme = repo
    tables.main(["--results", str(results), "--readme", str(readme)])
    text = readme.read_text()
    before, after = README.split(tables.BEGIN)[0], README.split(tables.END)[1]
    assert text.startswith(before + tables.BEGIN + "\n") and text.endswith(tables.END + after)
    assert "stale 9.9%" not in text
    first = text
    tables.main(["--results", str(results), "--readme", str(readme)])  # idempotent
    assert readme.read_text() == first


def test_check_detects_a_stale_readme_and_changes_nothing(repo, capsys):
    results, readme = repo
    args = ["--results", str(results), "--readme", str(readme)]
    assert tables.main([*args, "--check"]) == 1
    assert readme.read_text() == README
    assert "out of date" in capsys.readouterr().out.strip().splitlines()[-1]
    tables.main(args)
    assert tables.main([*args, "--check"]) == 0
    data = json.loads((results / "generation.json").read_text())
    data["ratio_vllm_vs_hf"] = 2.5  # a result changes: the README is stale again
    (results / "generation.json").write_text(json.dumps(data))
    assert tables.main([*args, "--check"]) == 1


def test_a_readme_without_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    assert tables.main(["--results", str(tmp_path), "--readme", str(readme)]) == 2
    assert readme.read_text() == "no markers\n"


def test_the_committed_readme_matches_the_committed_results():
    """Fails when a result JSON changed without `python benchmarks/tables.py`, or someone edited a
    figure in the generated section by hand."""
    assert tables.main(["--check"]) == 0, "run python benchmarks/tables.py and commit README.md"
