"""DAPO dynamic sampling, overlong shaping and KL-as-reward shaping in a real run: real Monarch
processes, the tiny model, the learner's frozen reference policy. In the slow tier (CI runs it):
test_grpo_loop checks each of these properties with fake meshes in the default suite."""

import pytest

from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training

pytestmark = [pytest.mark.monarch, pytest.mark.slow]

COMMON = ["trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.export_final=false",
          "trainer.checkpoint.every=0", "trainer.steps=2"]


def test_dynamic_sampling_without_signal_spends_its_rounds_and_says_so(tiny_run_config, caplog):
    # the arithmetic grader gives the random tiny model 0 everywhere: every group is uniform, so
    # dynamic sampling spends its extra round, counts the drops and trains on nothing
    cfg = tiny_run_config("output.name=dynamic", *COMMON, "rewarder.reward_fn=null",
                          "trainer.advantage.drop_uniform_groups=true", "trainer.advantage.max_extra_rounds=1")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2
    for r in train:
        assert r["batch/sampling_rounds"] == 2  # the first round plus the one extra allowed
        assert r["batch/dropped_uniform_groups"] == 8 and r["batch/missing_groups"] == 4
        assert r["batch/datums"] == 0 and r["loss/grpo"] == 0.0
    assert "dynamic sampling: 0 of 4 groups informative after 2 rounds" in caplog.text


def test_overlong_and_kl_shaping_in_a_real_run(tiny_run_config):
    cfg = tiny_run_config("output.name=kl", *COMMON, "trainer.advantage.kl_coef=0.5",
                          "trainer.advantage.overlong_cache_tokens=8")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert all(r["count/overlong_penalised"] > 0 for r in train)  # 16-token replies reach the 8-token window
    # step 1 samples with the initial weights = the reference: sampler and reference agree up to the
    # engine/learner numeric difference; step 2 samples with the updated policy, which has moved
    assert abs(train[0]["kl/sampler_reference_k1"]) < 0.05
    assert train[1]["kl/sampler_reference_k1"] > abs(train[0]["kl/sampler_reference_k1"])
    assert train[0]["batch/skipped_zero_advantage"] == 0  # shaping gives every sequence a signal
