"""benchmarks/ablation.py and ablation_report.py: the plan and commands of the runs, run files
kept only with the same settings, and the verdict's statistics against hand-computed values."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[f"bench_{name}"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ablation, report = _load("ablation"), _load("ablation_report")
import benchmarks.common as common  # noqa: E402 (the repository root is on sys.path above)
import benchmarks.tables as tables  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": 8, "eval_every": 4, "eval_size": 200, "code_steps": 4, "code_eval_every": 2,
                                 "code_eval_size": 50, "arms": list(ablation.ARMS), "tasks": ["arithmetic", "code"],
                                 "seeds": [0, 1], "code_seeds": [0], "contrast_seeds": [0], **kw})


def test_the_plan_runs_each_seeds_main_arms_together_and_the_contrast_arms_last():
    keys = ablation.plan(_args())
    assert keys[:4] == [(arm, "arithmetic", 0) for arm in ablation.MAIN_ARMS]
    assert keys[4:8] == [(arm, "arithmetic", 1) for arm in ablation.MAIN_ARMS]
    assert keys[8:12] == [(arm, "code", 0) for arm in ablation.MAIN_ARMS]
    assert keys[12:] == [(arm, "arithmetic", 0) for arm in ("replay-student", "sdpo-a0.05", "sdpo-a0.3",
                                                            "replay-b0.03", "replay-b0.3", "replay-b1.0",
                                                            "full-b0.03", "replay-e0", "replay-e0.4",
                                                            "replay-b0.03-d0.03", "replay-b0.03-d0.3",
                                                            "sdpo-h-noanswer", "sdpo-h-worked")]


def test_commands_select_the_arms_config_task_and_seed():
    cmd = ablation.command("full", "code", 2, ablation.settings("code", _args()))
    assert cmd[cmd.index("-c") + 1] == "configs/ablation-full.yaml"
    for override in ("trainer.seed=2", "generator.seed=2", "task.kind=code", "task.code.env.task_source=meshrl_easy",
                     "task.code.heldout_limit=50", "trainer.steps=4", "trainer.eval.every=2",
                     "replay.teachers.canonicaliser=code", "output.name=ablation-full-code-s2"):
        assert override in cmd
    sweep = ablation.command("sdpo-a0.3", "arithmetic", 0, ablation.settings("arithmetic", _args()))
    assert "configs/ablation-sdpo.yaml" in sweep and "sdpo.alpha=0.3" in sweep and "trainer.eval.size=200" in sweep
    for arm, (config, _) in ablation.ARMS.items():
        assert (ROOT / "configs" / f"ablation-{config}.yaml").exists(), arm


def test_the_first_round_runs_replay_at_the_weight_it_used_and_later_rounds_at_the_configs():
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    def beta(cmd):
        overrides = cmd[cmd.index("-c") + 2:]
        return load_config(RunConfig, cmd[cmd.index("-c") + 1], [o for o in overrides if "=" in o]).replay.beta

    s = ablation.settings("arithmetic", _args())
    assert beta(ablation.command("full", "arithmetic", 0, s)) == 0.1
    assert beta(ablation.command("replay-e0", "arithmetic", 0, s)) == 0.1
    assert beta(ablation.command("replay-b0.3", "arithmetic", 0, s)) == 0.3  # the arm's own setting wins
    assert beta(ablation.command("full", "arithmetic", 0, s, "per-second")) == 0.03
    assert beta(ablation.command("replay", "arithmetic", 0, s, "per-second")) == 0.03


def test_each_round_runs_sdpo_as_it_did():
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    def sdpo(cmd):
        overrides = cmd[cmd.index("-c") + 2:]
        c = load_config(RunConfig, cmd[cmd.index("-c") + 1], [o for o in overrides if "=" in o]).sdpo
        return c.candidates_per_site, c.cost_share, c.min_shared_prefix

    s = ablation.settings("arithmetic", _args())
    for arm in ("sdpo", "full", "sdpo-a0.3"):
        for round_ in ("", "per-second"):
            assert sdpo(ablation.command(arm, "arithmetic", 0, s, round_)) == (1.0, 0.0, 0)
        assert sdpo(ablation.command(arm, "arithmetic", 0, s, "budget")) == (2.0, 0.1, 16)
        assert sdpo(["meshrl", "train", "-c", f"configs/ablation-{ablation.ARMS[arm][0]}.yaml"]) == (1.0, 0.0, 16)


def test_a_sweep_arm_gets_the_teachers_of_its_config():
    assert ablation.teacher_kind("replay-b1.0") == ablation.teacher_kind("replay") == "oracle"
    assert ablation.teacher_kind("replay-student") == "student"
    assert ablation.teacher_kind("sdpo-a0.3") is None
    assert ablation.teacher_kind("replay-b0.03-d0.3") == "oracle"
    cmd = ablation.command("replay-b1.0", "code", 0, ablation.settings("code", _args()))
    assert "replay.beta=1.0" in cmd and "replay.teachers.canonicaliser=code" in cmd


def test_the_teacher_sweep_arms_set_the_oracles_error_rate_over_the_command_line():
    args = _args(oracle_error_rate=0.2, oracle_latency_s=0.5)
    assert ablation.oracle_config("replay", "arithmetic", args).error_rate == 0.2
    never = ablation.oracle_config("replay-e0", "code", args)
    assert (never.error_rate, never.latency_s, never.task, never.code_source) == (0.0, 0.5, "code", "meshrl_easy")
    assert ablation.oracle_config("replay-e0.4", "arithmetic", args).error_rate == 0.4


def test_the_hint_arms_load_their_templates_through_the_config():
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.sdpo.sites import render_hint

    fields = {"a": 12, "op": "*", "b": 3, "answer": "36", "extracted": 35}
    for arm, wrong, no_format in (
            ("sdpo-h-noanswer", "Hint: 35 is not right.", "Hint: finish with the final result as a plain number."),
            ("sdpo-h-worked", "Hint: 12 * 3 = 36, so 35 is wrong. Reply with 36.",
             "Hint: 12 * 3 = 36. End your reply with the number 36.")):
        config, extra = ablation.ARMS[arm]
        hints = load_config(RunConfig, ROOT / "configs" / f"ablation-{config}.yaml", extra).sdpo.hints
        assert render_hint(hints, "math.wrong_answer", fields) == wrong
        assert render_hint(hints, "math.wrong_format", fields) == no_format
    default = load_config(RunConfig, ROOT / "configs" / "ablation-sdpo.yaml").sdpo.hints
    assert "36" in render_hint(default, "math.wrong_answer", fields)


def test_a_run_file_counts_only_with_the_same_settings_in_its_own_round(tmp_path, monkeypatch):
    monkeypatch.setattr(ablation, "RESULTS", tmp_path)
    key = ("baseline", "arithmetic", 0)
    s = ablation.settings("arithmetic", _args())
    assert ablation.recorded(key, s, "") is None
    path = ablation.run_file(key, "")
    assert path == tmp_path / "ablation" / "ablation-baseline-arithmetic-s0.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"arm": "baseline", **s}))
    assert ablation.recorded(key, s, "")["arm"] == "baseline"
    assert ablation.recorded(key, {**s, "steps": 32}, "") is None
    # a later round keeps its own runs: the first round's file does not count there
    assert ablation.run_file(key, "per-second") == tmp_path / "ablation-per-second" / "ablation-baseline-arithmetic-s0.json"
    assert ablation.recorded(key, s, "per-second") is None


def _run(arm, seed, step_s, accuracies, steps=8, every=4):
    evals = [{"step": k * every, "accuracy": a, "train_s": k * every * step_s} for k, a in enumerate(accuracies)]
    return {"arm": arm, "task": "arithmetic", "seed": seed, "steps": steps, "eval_every": every, "eval_size": 200,
            "evals": evals, "train_s": steps * step_s, "mean_step_s": step_s,
            "mean_parts_s": {"generate_s": 1.0}, "steps_with_nonzero": {"loss/sdpo_jsd": 0},
            "load_1m": {"mean": 2.0, "max": 3.0}, "commit": "abc1234", "date": "2030-01-01", "faults": []}


RUNS = [_run("baseline", 0, 10.0, [0.1, 0.2, 0.3]), _run("baseline", 1, 10.0, [0.1, 0.1, 0.5]),
        _run("full", 0, 15.0, [0.1, 0.3, 0.4]), _run("full", 1, 15.0, [0.1, 0.5, 0.5]),
        _run("sdpo", 0, 12.0, [0.1, 0.1, 0.2]), _run("sdpo", 0, 12.0, [0.1, 0.2, 0.3, 0.4, 0.5], steps=16)]


def test_the_verdict_pairs_each_seed_with_its_baseline():
    t = report.summarise(RUNS)["arithmetic"]
    assert t["settings"] == {"steps": 8, "eval_every": 4, "eval_size": 200}
    assert t["left_out"] == ["sdpo-s0"]  # the 16-step run
    full = t["arms"]["full"]
    assert full["final"]["mean"] == pytest.approx(0.45) and full["final"]["std"] == pytest.approx(0.05)
    assert full["diff_final"]["values"] == pytest.approx([0.1, 0.0])
    # the baseline trained 80 s: full's last eval within 80 s is step 4 (60 s)
    assert full["equal_wall"]["values"] == pytest.approx([0.3, 0.5])
    assert full["diff_equal_wall"]["values"] == pytest.approx([0.0, 0.0])
    assert full["reach_baseline_final"] == [{"seed": 0, "steps_frac": 0.5, "train_s_frac": 0.75},
                                            {"seed": 1, "steps_frac": 0.5, "train_s_frac": 0.75}]
    assert full["step_vs_baseline"]["mean"] == pytest.approx(1.5)
    assert [p["mean"] for p in full["curve"]] == pytest.approx([0.1, 0.4, 0.45])
    sdpo = t["arms"]["sdpo"]
    assert sdpo["reach_baseline_final"] == [None] and sdpo["diff_final"]["values"] == pytest.approx([-0.1])
    text = tables.ablation({"tasks": report.summarise(RUNS), "runs": [
        {"run": "x", "commit": "abc1234", "date": "2030-01-01", "load_1m_mean": 2.0, "faults": ["learner lost"]}]})
    assert "| full | 2 | 10.0% → 45.0% ± 5.0 | +5.0% ± 5.0 | 40.0% ± 10.0 | +0.0% ± 0.0 | 0.50 / 0.75, 0.50 / 0.75 " \
           "(meets the target) |" in text
    assert "| sdpo | 1 | 10.0% → 20.0% | -10.0% | 10.0% | -20.0% | never (misses the target) |" in text
    assert "Left out (other settings): sdpo-s0." in text and "Fault during x: learner lost" in text


def test_the_summary_files_are_written_from_the_run_files(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    runs = tmp_path / "ablation"
    runs.mkdir()
    for i, r in enumerate(RUNS[:4]):
        (runs / f"run{i}.json").write_text(json.dumps(r))
    written = report.write_summary(runs)
    summary = json.loads((tmp_path / "ablation.json").read_text())
    assert set(summary["tasks"]["arithmetic"]["arms"]) == {"baseline", "full"} and len(summary["runs"]) == 4
    assert written[1].stat().st_size > 10_000  # the PNG


def test_the_per_second_round_bounds_the_full_steps_mean_time_and_every_seeds():
    def arm(*fracs):
        return {"reach_baseline_final": [{"seed": i, "steps_frac": 0.9, "train_s_frac": f} for i, f in enumerate(fracs)]}

    def verdict(name, *fracs):
        return tables._reach(name, arm(*fracs), tables.PER_SECOND_TARGETS, tables.PER_SECOND_FULL_MEAN)

    assert verdict("full", 0.7, 0.7).endswith("(meets the target)")
    assert verdict("full", 0.8, 0.8).endswith("(misses the target)")  # each seed within 0.9, the mean above 0.75
    assert verdict("full", 0.5, 0.95).endswith("(misses the target)")  # the mean within, one seed above 0.9
    assert verdict("sdpo", 1.0, 0.4).endswith("(meets the target)")  # no step bound in this round
    assert verdict("replay", 1.05, 0.4).endswith("(misses the target)")
    assert tables._reach("full", {"reach_baseline_final": [None]}, tables.PER_SECOND_TARGETS, 0.75) == \
        "never (misses the target)"
