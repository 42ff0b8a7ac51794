"""benchmarks/tables.py: docs/benchmarks.md's tables and the README's headline figures are rendered
from result JSON, in place between each file's markers, and the committed pages match the committed
JSON (so no one types those figures by hand)."""

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
DOCS = "# Benchmarks\n\nprose before, 1.23 s typed by hand\n\n<!-- bench:begin -->\nstale 9.9%\n<!-- bench:end -->\n\nafter\n"
ENV_DOCS = "# Environments\n\n<!-- env-examples:begin -->\nstale\n<!-- env-examples:end -->\n"
README = ("# title\n\nintro\n\n<!-- headline:begin -->\nstale 1.0%\n<!-- headline:end -->\n\n"
          "## later\n\nmore prose\n")


@pytest.fixture
def repo(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, data in (("sync_vs_async", SYNC), ("generation", GENERATION), ("ablation", ABLATION),
                       ("vs_trl", VS_TRL)):
        (results / f"{name}.json").write_text(json.dumps(data))
    docs = tmp_path / "benchmarks.md"
    docs.write_text(DOCS)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    (tmp_path / "environments.md").write_text(ENV_DOCS)
    return results, docs, readme


def paths(results: Path, docs: Path, readme: Path) -> list[str]:
    return ["--results", str(results), "--docs", str(docs), "--readme", str(readme),
            "--env-docs", str(results.parent / "environments.md")]


def section(path: Path, begin: str = tables.BEGIN, end: str = tables.END) -> str:
    text = path.read_text()
    return text[text.index(begin):text.index(end)]


def headline(readme: Path) -> str:
    return section(readme, tables.HEADLINE_BEGIN, tables.HEADLINE_END)


def test_the_docs_section_has_the_figures_of_the_json(repo):
    results, docs, readme = repo
    assert tables.main(paths(*repo)) == 0
    out = section(docs)
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


def test_the_environment_examples_curves_go_into_the_environments_page(repo):
    results, docs, readme = repo
    env_docs = results.parent / "environments.md"
    assert tables.main(paths(*repo)) == 0
    assert "not yet measured: run `python benchmarks/env_examples.py`" in env_docs.read_text()
    run = {"env": "tutor", "eval_size": 100, "mean_step_s": 21.5,
           "evals": [{"step": 0, "success": 0.14, "mean_return": 0.108}, {"step": 32, "success": 0.5, "mean_return": 0.41}]}
    (results / "env_examples.json").write_text(json.dumps({**PROVENANCE, "runs": [
        {**run, "arm": "grpo"}, {**run, "arm": "full", "mean_step_s": 30.0, "evals": run["evals"][:1]}]}))
    assert tables.main(paths(*repo)) == 0
    out = section(env_docs, tables.ENV_BEGIN, tables.ENV_END)
    assert "`AdditionTutorEnv`, a class in the env mesh's processes" in out and "100 held-out episodes" in out
    assert "| step | 0 | 32 |" in out
    assert "| GRPO alone: success | 14.0% | 50.0% |" in out and "| GRPO alone: mean return | 0.108 | 0.410 |" in out
    assert "| GRPO + SDPO + trace-replay DPO (oracle teacher): success | 14.0% | — |" in out
    assert "Mean step: GRPO alone 21.5 s, GRPO + SDPO + trace-replay DPO (oracle teacher) 30.0 s." in out
    assert "x86_64, Test CPU, 2 cores, 8 GiB, no GPU; 2030-01-02, commit abc1234." in out


def test_the_readme_headline_has_the_default_jobs_figures(repo):
    results, docs, readme = repo
    assert tables.main(paths(*repo)) == 0
    out = headline(readme)
    # the default job is the K = 0 run: its curve, mean step and wall, not the K = 1 run's
    assert "| step | 0 | 16 |" in out and "| held-out greedy accuracy | 6.5% | 12.5% |" in out
    assert "25.0%" not in out and "20.0 s" not in out
    assert "Mean step 10.0 s; the whole run (spawn, 16 steps, evals, export) 600 s (10.0 min)." in out
    assert ("`python benchmarks/sync_vs_async.py` → `benchmarks/results/sync_vs_async.json`; "
            "x86_64, Test CPU, 2 cores, 8 GiB, no GPU; 2030-01-02, commit abc1234.") in out
    # its step time against TRL
    assert "TRL 10.00 s; meshrl, separate meshes 6.00 s (0.60x)." in out
    # the full tables stay in the docs page
    assert "### " not in out and "vLLM / HF generate" not in out


def test_a_missing_result_is_one_line_naming_its_script(repo):
    results, docs, readme = repo
    tables.main(paths(*repo))
    out = section(docs)
    assert "### Learner throughput with 1 and 2 data-parallel processes\n\n" \
           "not yet measured: run `python benchmarks/learner_scaling.py`\n" in out
    assert "not yet measured: run `python benchmarks/sync_vs_async.py`" not in out
    (results / "sync_vs_async.json").unlink()
    (results / "vs_trl.json").unlink()
    tables.main(paths(*repo))
    out = headline(readme)
    assert "The default job: not yet measured: run `python benchmarks/sync_vs_async.py`" in out
    assert "Against TRL's GRPOTrainer: not yet measured: run `python benchmarks/vs_trl.py`" in out


def test_only_the_text_between_the_markers_is_replaced_in_both_files(repo):
    results, docs, readme = repo
    tables.main(paths(*repo))
    for path, original, begin, end, stale in ((docs, DOCS, tables.BEGIN, tables.END, "stale 9.9%"),
                                              (readme, README, tables.HEADLINE_BEGIN, tables.HEADLINE_END,
                                               "stale 1.0%")):
        text = path.read_text()
        before, after = original.split(begin)[0], original.split(end)[1]
        assert text.startswith(before + begin + "\n") and text.endswith(end + after)
        assert stale not in text
    first = docs.read_text(), readme.read_text()
    tables.main(paths(*repo))  # idempotent
    assert (docs.read_text(), readme.read_text()) == first


def test_check_detects_a_stale_file_and_changes_nothing(repo, capsys):
    results, docs, readme = repo
    args = paths(*repo)
    assert tables.main([*args, "--check"]) == 1
    assert docs.read_text() == DOCS and readme.read_text() == README
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and all("out of date" in line for line in out)  # one line per stale file
    tables.main(args)
    assert tables.main([*args, "--check"]) == 0
    capsys.readouterr()
    # a result only the docs page shows changes: the docs page alone is stale
    data = json.loads((results / "generation.json").read_text())
    data["ratio_vllm_vs_hf"] = 2.5
    (results / "generation.json").write_text(json.dumps(data))
    assert tables.main([*args, "--check"]) == 1
    assert capsys.readouterr().out.strip().splitlines() == [
        f"{docs} is out of date with {results}: run python benchmarks/tables.py"]
    tables.main(args)
    # a hand edit of the README's headline is stale too
    readme.write_text(readme.read_text().replace("| 6.5% |", "| 7.5% |"))
    assert tables.main([*args, "--check"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"{readme} is out of date")


def test_a_file_without_its_markers_is_refused_and_nothing_is_written(repo):
    results, docs, readme = repo
    readme.write_text("no markers\n")  # the docs page would change, but nothing is written
    assert tables.main(paths(*repo)) == 2
    assert docs.read_text() == DOCS and readme.read_text() == "no markers\n"
    readme.write_text(DOCS)  # the bench markers are not the README's: it needs the headline pair
    assert tables.main(paths(*repo)) == 2
    docs.write_text(README)
    readme.write_text(README)
    assert tables.main(paths(*repo)) == 2
    assert docs.read_text() == README


def test_the_committed_pages_match_the_committed_results():
    """Fails when a result JSON changed without `python benchmarks/tables.py`, or someone edited a
    figure in a generated section (docs/benchmarks.md or the README's headline) by hand."""
    assert tables.main(["--check"]) == 0, "run python benchmarks/tables.py and commit docs/benchmarks.md and README.md"


def test_the_gpu_battery_renders_each_parts_figures_with_the_device_named():
    result = {**PROVENANCE, "device": "1 x NVIDIA H200", "torch_cuda": "13.0", "mode": "quick",
              "summary": {"passed": 3, "failed": 0, "skipped": 1}, "parts": {
                  "auto_placement": {"status": "passed", "facts": {"steps": 4, "step_s_median": 0.61,
                                                                   "sync_transport": ["shared"], "placement_verified": True}},
                  "weight_pull_ipc": {"status": "passed", "facts": {"synthetic-0.50B-bf16": {
                      "nbytes": 1e9, "memcpy_gbps": 1500.0, "arena_device": "cuda",
                      "shm": {"pull_s": 0.0012, "pull_vs_memcpy": 0.55}}}},
                  "hf_generation": {"status": "passed", "facts": {"tokens_per_s": {"hf-eager": 1700.0, "hf-static": 6000.0},
                                                                  "ratio_static_vs_eager": 3.53}},
                  "vs_trl_hf": {"status": "skipped: TRL does not import"}}}
    text = tables.gpu_check(result)
    assert text.startswith("1 x NVIDIA H200 (torch CUDA 13.0), the quick battery (`--quick`): 3 passed")
    assert "| `auto_placement` | passed | 0.61 s per step, sync over shared, placement verified |" in text
    assert "synthetic-0.50B-bf16 (1,000 MB, shm): 1.2 ms, 0.550 of the device memcpy" in text
    assert "hf-eager 1,700 tokens/s, hf-static 6,000 tokens/s; static / eager 3.53x" in text
    assert "| `vs_trl_hf` | skipped: TRL does not import | — |" in text


def test_a_generation_result_of_the_hf_paths_only_renders_their_ratio():
    rows = [{"backend": "hf-eager", "tokens_per_s": 100.0, "tokens": 1000, "seconds": 10.0},
            {"backend": "hf-static", "tokens_per_s": 350.0, "tokens": 1000, "seconds": 2.9}]
    result = {k: v for k, v in GENERATION.items() if k != "ratio_vllm_vs_hf"}
    text = tables.generation({**result, "device": "NVIDIA H200", "rows": rows, "ratio_static_vs_eager": 3.5})
    assert "on NVIDIA H200" in text and "HF static path / HF eager path: 3.50x tokens/s." in text
    assert "vLLM / HF" not in text


def test_the_headline_names_the_cpu_and_shows_the_curves_of_other_cpus(repo):
    """With default_job_cpus.json the headline's curve names its CPU, each other CPU's curve is a
    row of the same table (aligned by step, a dash where it has no eval), and one line says how curves
    vary across machines."""
    results, docs, readme = repo
    other = {"runs": [{"machine": "x86_64, Other CPU (AVX-512), 2 cores", "date": "2030-01-03", "commit": "def5678",
                       "measured": "by hand", "repeats": 2, "identical": True, "mean_step_s": 18.5,
                       "eval": [{"step": 0, "accuracy": 0.065}, {"step": 8, "accuracy": 0.09}]}]}
    (results / "default_job_cpus.json").write_text(json.dumps(other))
    assert tables.main(paths(*repo)) == 0
    out = headline(readme)
    assert "| held-out greedy accuracy, Test CPU | 6.5% | 12.5% |" in out
    assert "| the same job, Other CPU (AVX-512) | 6.5% | — |" in out
    assert "differ across CPU types" in out and "twice in a row, identically, mean step 18.5 s" in out
    assert "(by hand; 2030-01-03, commit def5678)" in out
    assert tables.cpu_of("x86_64, 2 cores") is None and tables.cpu_of("x86_64, AMD EPYC, 2 cores") == "AMD EPYC"
