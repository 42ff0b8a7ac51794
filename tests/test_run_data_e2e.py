"""The data a run keeps, end to end: a tiny arithmetic run (single turn) with the replay term and
three real HTTP teachers on loopback writes `trajectories.jsonl` and `pairs.jsonl` step by step, and
`meshrl sft` trains on them: on the file's successful trajectories (token in, token out) and, offline
DPO, on its teacher pairs against the frozen starting policy. (The multi-turn code task's files are
checked in tests/test_code_runtime.py.)"""

import json

import pytest

from meshrl.config.base import load_config
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.sft import sft_main
from meshrl.controller.train import make_run_dir, run_training
from meshrl.metrics.records import read_metrics
from meshrl.testing.fake_openai import Fault, FakeOpenAIServer
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.monarch


def _teachers(url):
    entries = [f"{{name: t{i}, base_url: '{url}', model: m{i}, timeout_s: 5, max_retries: 1, backoff_base_s: 0.1,"
               f" backoff_max_s: 0.2}}" for i in range(3)]
    return "replay.teachers.teachers=[" + ", ".join(entries) + "]"


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _sft(tmp_path, name, session, *overrides):
    cfg = load_config(SFTRunConfig, None, [*TINY_RUN, f"output.dir={tmp_path}", f"output.name={name}",
                                           "trainer.checkpoint.export_final=false", *overrides])
    assert sft_main(cfg, session=session) == 0
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "eval"]


@pytest.mark.slow  # over a minute: the default suite's budget is kept for the faster checks
@pytest.mark.timeout(900)  # a 4-step run with teachers, then two fine-tuning runs
def test_an_arithmetic_run_keeps_its_trajectories_and_pairs_and_sft_and_dpo_train_on_them(tiny_run_config,
                                                                                          tiny_session, tmp_path):
    script = {"m0": "The answer is 42.", "m1": "42", "m2": Fault("server_error")}
    with FakeOpenAIServer(script) as server:
        cfg = tiny_run_config("output.name=kept", "trainer.steps=4", "trainer.eval.every=0",
                              "trainer.eval.at_start=false", "trainer.checkpoint.export_final=false",
                              "trainer.checkpoint.every=0", "replay.beta=0.5", "replay.pool.procs=1",
                              _teachers(server.base_url))
        run_dir = make_run_dir(cfg, overwrite=True)
        run_training(cfg, run_dir, session=tiny_session)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]

    # every trajectory of every step: 4 prompts x 4 samples, token ids and logprobs as sampled
    trajectories = _lines(run_dir / "trajectories.jsonl")
    assert [r["step"] for r in trajectories] == [s for s in range(1, 5) for _ in range(16)]
    for r in trajectories:
        assert r["kind"] == "trajectory" and r["trained"] is True and r["prompt_tokens"]
        assert len(r["tokens"]) == len(r["logprobs"]) == len(r["mask"]) and set(r["mask"]) <= {1}
        assert r["version"] == r["step"] - 1 and r["termination"] in ("stop", "length")
        assert isinstance(r["correct"], bool) and r["reward"] == pytest.approx(sum(r["reward_parts"].values()))
    for step, r in zip(range(1, 5), train):
        rewards = [t["reward"] for t in trajectories if t["step"] == step]
        assert r["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))

    # every pair the teachers agreed on (t0 and t1 on 42; t2 fails), as the replay term counted them
    pairs = _lines(run_dir / "pairs.jsonl")
    assert pairs and len([p for p in pairs if p["status"] == "buffered"]) == train[-1]["replay/dpo_items"]
    for p in pairs:
        assert p["teachers"] == ["t0", "t1"] and p["agreement"] == "2 of 3" and p["chosen_text"] == "The answer is 42."
        assert p["chosen"] and p["rejected"] and p["prompt_tokens"] and p["context"][-1]["role"] == "user"
        assert 1 <= p["step"] <= 4 and p["version"] < p["step"]

    # meshrl sft --trajectories: the trajectories with the 8 best rewards (ties included), from their
    # token ids, all of them in every step: the NLL of the same examples falls
    threshold = sorted(r["reward"] for r in trajectories)[-8]
    best = [r for r in trajectories if r["reward"] >= threshold]
    sft_train, _ = _sft(tmp_path, "from-trajectories", tiny_session,
                        f"sft.trajectories={run_dir / 'trajectories.jsonl'}", f"sft.min_reward={threshold}",
                        "sft.eval_fraction=0", f"sft.batch_size={len(best)}", "sft.steps=4", "sft.lr_schedule=constant")
    assert len(sft_train) == 4 and sft_train[-1]["train/nll"] < sft_train[0]["train/nll"]
    # the loss weighs exactly the sampled tokens of those trajectories (the first is never predicted)
    assert all(r["train/loss_tokens"] == sum(sum(b["mask"]) for b in best) for r in sft_train)
    assert (tmp_path / "from-trajectories" / "checkpoints" / "step-000004").is_dir()

    # offline DPO on the pairs file, the same pairs held out: their accuracy rises from 0 (policy = reference)
    pairs_file = run_dir / "pairs.jsonl"
    dpo_train, evals = _sft(tmp_path, "dpo", tiny_session, f"sft.pairs={pairs_file}", f"sft.eval_data={pairs_file}",
                            "sft.batch_size=4", "sft.steps=3", "sft.eval_every=0", "sft.lr_schedule=constant",
                            "learner.lr=1e-3")
    assert [e["step"] for e in evals] == [0, 3]
    assert evals[0]["eval/preference_accuracy"] == 0 and evals[-1]["eval/preference_accuracy"] > 0.5
    assert evals[-1]["eval/dpo_loss"] < evals[0]["eval/dpo_loss"]
    assert dpo_train[-1]["train/dpo_loss"] < dpo_train[0]["train/dpo_loss"]
    assert (tmp_path / "dpo" / "checkpoints" / "step-000003").is_dir()

    from meshrl.report import write_report
    from meshrl.report.runs import load_run
    from meshrl.report.summary import headline

    _, _, panels = write_report(tmp_path / "dpo")  # the dashboard draws the DPO losses
    assert next(p for p in panels if p.title == "Loss terms").artists == 2
    assert "held-out preference accuracy 0.0% → " in headline(load_run(tmp_path / "dpo"))
