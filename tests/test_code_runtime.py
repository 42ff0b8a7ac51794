"""The multi-turn code task in the runtime: real Monarch processes, the vLLM generator, the env
mesh running episodes in the sandbox; episodes saved as trajectory records (the env's record merged
into each line), which `meshrl sft --trajectories` trains on."""

import json

import pytest

from meshrl.config.base import load_config
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.sft import sft_main
from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.monarch

CODE = ["task.kind=code", "task.code.env.code.max_turns=2", "task.code.heldout_limit=2", "trainer.eval.size=2",
        "generator.sampling.max_new_tokens=48", "model.max_model_len=1024", "rewarder.reward_fn=null",
        "trainer.checkpoint.export_final=false"]


def _check_run(run_dir, steps, group_size, prompts):
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    assert all(r["batch/trajectories"] == group_size * prompts for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all(r["eval/n"] == 2 for r in evals)
    lines = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    train_eps = [e for e in lines if e["kind"] == "trajectory"]
    assert len(train_eps) == steps * group_size * prompts
    # the evaluation episodes' env records come last, on lines of their own
    others = [e for e in lines if e["kind"] != "trajectory"]
    assert all(e["kind"] == "episode" and e["episode_id"].startswith("eval") for e in others)
    for e in train_eps:
        # one line: the trajectory's tokens and the env's own record of the episode
        assert e["episode_id"] == e["id"] and 1 <= e["num_turns"] <= 2 and len(e["turns"]) == e["num_turns"]
        assert len(e["info"]["turns"]) == e["num_turns"] and len(e["tokens"]) == len(e["mask"]) == len(e["logprobs"])
        assert (0 in e["mask"]) == (e["num_turns"] == 2)  # the env's feedback turn is in the tokens, not sampled
        assert e["termination"] in ("success", "max_turns", "submitted", None)
        assert e["messages"][0]["role"] in ("system", "user")
        assert all("error_kind" in t and "feedback" in t for t in e["turns"])
        assert [s["turn"] for s in e["error_sites"]] == [i for i, t in enumerate(e["turns"]) if t["error_kind"]]
    return train, train_eps


@pytest.mark.slow  # ~12 s on 2 cores
def test_code_task_runs_multi_turn_grpo_with_the_tiny_model(tiny_run_config, tiny_session, tmp_path):
    cfg = tiny_run_config("output.name=code-tiny", "trainer.steps=2", "trainer.prompts_per_step=2",
                          "trainer.group_size=2", *CODE,
                          "faults.inject=[{mesh: env, at_step: 2, action: kill, during: step_start}]")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir, session=tiny_session)
    train, episodes = _check_run(run_dir, 2, 2, 2)
    # the env process was killed before step 2: replaced, and the step's episodes replayed in full
    faults = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "fault"]
    assert [f["mesh"] for f in faults] == ["env"] and train[-1]["faults/restarts/env"] == 1
    # the random model never writes valid code: every episode uses both turns and fails with a marker
    assert all(e["num_turns"] == 2 for e in episodes)
    assert all(t["error_kind"] for e in episodes for t in e["turns"])
    assert train[-1]["episodes/mean_turns"] == 2

    # meshrl sft reads the file back, token in and token out: every episode failed, so a reward
    # threshold at the lowest reward admits all; the loss weighs the policy's sampled tokens only
    cfg = load_config(SFTRunConfig, None, [*TINY_RUN, f"output.dir={tmp_path}", "output.name=code-sft",
                                           f"sft.trajectories={run_dir / 'trajectories.jsonl'}",
                                           f"sft.min_reward={min(e['reward'] for e in episodes)}",
                                           "sft.eval_fraction=0", "sft.batch_size=4", "sft.steps=4",
                                           "sft.lr_schedule=constant", "model.max_model_len=1024",
                                           "trainer.checkpoint.export_final=false"])
    assert sft_main(cfg, session=tiny_session) == 0
    sft = [r for r in read_metrics(tmp_path / "code-sft" / "metrics.jsonl") if r["kind"] == "train"]
    assert sft[0]["train/loss_tokens"] == sum(sum(e["mask"]) for e in episodes[:4])  # seed 0: the file's order
    assert sft[-1]["train/nll"] < sft[0]["train/nll"]


@pytest.mark.slow
def test_code_task_with_the_real_model(tiny_run_config):
    cfg = tiny_run_config("output.name=code-real", "model.name_or_path=smollm2-135m-instruct", "trainer.steps=2",
                          "trainer.prompts_per_step=1", "trainer.group_size=4", "learner.lr=1e-5", *CODE,
                          "task.code.env.difficulty=[1]", "task.code.env.task_limit=2")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train, episodes = _check_run(run_dir, 2, 4, 1)
    assert any(t["code"] for e in episodes for t in e["turns"]), "the real model should write some code"
