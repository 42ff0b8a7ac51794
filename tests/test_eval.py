"""`meshrl eval`: the pass@k estimator, what a path is, one-line exits for a bad path or a model
that does not fit, and real evaluations of a 1-step tiny run (its latest checkpoint and its exported
model) that reproduce the run's own held-out evaluation."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest

from meshrl.cli import main
from meshrl.controller.evaluate import eval_main, eval_metrics, pass_at_k, resolve_target

from tests.conftest import TINY_RUN


# ---- the estimator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),                 # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),            # 1 - C(3,2) / C(5,2)
    (10, 3, 5, 1 - 21 / 252),         # 1 - C(7,5) / C(10,5)
    (20, 1, 10, 1 - 92378 / 184756),  # 1 - C(19,10) / C(20,10) = 0.5
    (4, 0, 2, 0.0),                   # never correct
    (4, 3, 2, 1.0),                   # one failure: every pair holds a success
    (1, 1, 1, 1.0),
])
def test_pass_at_k_against_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_combinatorial_formula_and_refuses_bad_arguments():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    for bad in ((3, 1, 4), (3, 4, 1), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_eval_metrics_average_pass_at_k_over_tasks():
    def sample(correct, reward):
        return SimpleNamespace(info={"correct": correct}, reward=reward)

    groups = [[sample(True, 1.0), sample(False, 0.0), sample(False, 0.0)], [sample(False, 0.5)] * 3]
    m = eval_metrics(groups, (1, 2))
    assert m["eval/accuracy"] == pytest.approx(1 / 6) and m["eval/n"] == 6 and m["eval/tasks"] == 2
    assert m["eval/reward_mean"] == pytest.approx(2.5 / 6)
    assert m["eval/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 3 + 0) / 2)  # task 1: 1 - C(2,2) / C(3,2)
    # what training logs: no pass@k keys
    assert set(eval_metrics(groups)) == {"eval/accuracy", "eval/reward_mean", "eval/n"}


# ---- paths -------------------------------------------------------------------------------------------
def _one_line_exit(capsys, *argv) -> str:
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshrl: eval: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file or directory"),
    ("file", "not a directory"),
    ("empty", "not a run directory, a checkpoint or an HF model directory"),
    ("run-without-checkpoint", "without a complete checkpoint"),
    ("incomplete-checkpoint", "an incomplete checkpoint"),
    ("model-without-weights", "no weights"),
])
def test_a_bad_path_exits_2_with_one_line(tmp_path, capsys, case, expected):
    path = tmp_path / case
    if case == "file":
        path.write_text("x")
    elif case != "missing":
        path.mkdir()
    if case == "run-without-checkpoint":
        (path / "config.yaml").write_text("{}\n")
        (path / "checkpoints" / ".tmp-step-000001").mkdir(parents=True)
    elif case == "incomplete-checkpoint":
        (path / "learner").mkdir()
    elif case == "model-without-weights":
        (path / "config.json").write_text("{}")
    assert expected in _one_line_exit(capsys, str(path))


def test_what_a_path_is(tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000003"
    (step / "learner" / "state").mkdir(parents=True)
    (step / "learner" / "learner.json").write_text("{}")
    (step / "controller.json").write_text('{"step": 3}')
    (step / "COMPLETE").write_text("ok\n")
    (run / "config.yaml").write_text("{}\n")
    (run / "final_model").mkdir()
    (run / "final_model" / "config.json").write_text("{}")
    (run / "final_model" / "model.safetensors").write_bytes(b"")
    for path, kind in ((run, "run"), (step, "checkpoint"), (step / "learner", "learner"),
                       (run / "final_model", "model")):
        target = resolve_target(path)
        assert target.kind == kind and target.config == run / "config.yaml", (path, target)
        assert target.learner_dir == (None if kind == "model" else step / "learner")
        assert target.step == (None if kind == "model" else 3)


# ---- real evaluations ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tiny_session, tmp_path_factory):
    """A 1-step tiny run (evaluated at steps 0 and 1, checkpoint at step 1, exported)."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.controller.train import make_run_dir, run_training

    cfg = load_config(RunConfig, None, TINY_RUN + [f"output.dir={tmp_path_factory.mktemp('eval')}", "output.name=run",
                                                   "trainer.steps=1"])
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir, session=tiny_session)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in evals if r["kind"] == "eval"][-1]


@pytest.mark.monarch
def test_eval_of_a_run_directory_reproduces_the_runs_evaluation(trained_run, tiny_session, tmp_path, capsys):
    run_dir, last = trained_run
    assert last["step"] == 1
    out = tmp_path / "eval.json"
    assert eval_main(str(run_dir), out=str(out), session=tiny_session) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "step 1" in line and "8 problems, greedy: accuracy" in line, line
    result = json.loads(out.read_text())
    assert result["kind"] == "run" and result["step"] == 1 and result["greedy"] and result["size"] == 8
    # the same prompts, greedy sampling and grading as the run's own evaluation of those weights
    assert result["eval/n"] == last["eval/n"] == 8
    assert result["eval/accuracy"] == last["eval/accuracy"]
    assert result["eval/reward_mean"] == pytest.approx(last["eval/reward_mean"], abs=1e-9)
    assert len(result["tasks"]) == 8 and all(t["samples"] == 1 for t in result["tasks"])


@pytest.mark.monarch
def test_pass_at_k_eval_of_a_checkpoint(trained_run, tiny_session, tmp_path, capsys):
    run_dir, _ = trained_run
    out = tmp_path / "eval.json"
    assert eval_main(str(run_dir / "checkpoints" / "step-000001"), overrides=["trainer.eval.size=4"], k=2, samples=3,
                     batch=3, out=str(out), session=tiny_session) == 0
    line = capsys.readouterr().out
    assert "3 samples each at temperature 1: pass@1" in line and "pass@2" in line, line
    result = json.loads(out.read_text())
    assert result["kind"] == "checkpoint" and not result["greedy"] and result["size"] == 4
    assert result["eval/n"] == 12 and [t["samples"] for t in result["tasks"]] == [3] * 4  # in batches of 3 tasks
    assert [t["id"] for t in result["tasks"]] == [f"heldout-{i}" for i in range(4)]
    per_task = [pass_at_k(3, t["correct"], 2) for t in result["tasks"]]
    assert result["eval/pass@2"] == pytest.approx(sum(per_task) / 4)
    assert result["eval/pass@1"] == pytest.approx(result["eval/accuracy"])


@pytest.mark.monarch
@pytest.mark.slow  # ~12 s on 2 cores
def test_eval_of_the_exported_model_reproduces_the_runs_evaluation(trained_run, tmp_path, capsys):
    """Meshes of its own (a session serves one model): about 25 s."""
    run_dir, last = trained_run
    out = tmp_path / "eval.json"
    assert eval_main(str(run_dir / "final_model"), out=str(out)) == 0
    assert "(HF model): held-out arithmetic, 8 problems, greedy: accuracy" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["kind"] == "model" and result["checkpoint"] is None and result["model"].endswith("final_model")
    assert result["eval/n"] == 8 and result["eval/accuracy"] == last["eval/accuracy"]
    assert result["eval/reward_mean"] == pytest.approx(last["eval/reward_mean"], abs=1e-9)


@pytest.mark.monarch
def test_a_model_that_does_not_fit_exits_2_before_spawning(trained_run, tmp_path, capsys):
    run_dir, _ = trained_run
    # a LoRA config for a checkpoint of full weights
    assert "holds full weights but learner.lora.enabled = True" in _one_line_exit(
        capsys, str(run_dir), "learner.lora.enabled=true")
    # a checkpoint of another model than the config names: same tokenizer, narrower layers
    other = tmp_path / "other"
    shutil.copytree(run_dir / "final_model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "head_dim": 32}))
    assert "a checkpoint of another model than model.name_or_path" in _one_line_exit(
        capsys, str(run_dir), f"model.name_or_path={other}")
    # an exported model whose embeddings do not cover its tokenizer
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    assert "the tokenizer is not this model's" in _one_line_exit(capsys, str(other))
