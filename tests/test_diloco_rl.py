"""Two RL replicas of one DiLoCo run, for real: two concurrent `meshrl train` jobs (each with its own
Monarch generator, learner and rewarder meshes, the HF engine, the tiny model) share only a file://
store. With inner_steps = 2 over 4 steps both end 2 rounds together with identical weights (the
same diloco/hash after each round), and the rollout shards both wrote are readable."""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.diloco.shards import ShardReader
from meshrl.diloco.store import ObjectStore
from tests.conftest import TINY_RUN

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

ROOT = Path(__file__).resolve().parents[1]


def _replica_cmd(tmp_path, store, replica):
    return [sys.executable, "-m", "meshrl.cli", "train", *TINY_RUN, "generator.backend=hf", "trainer.steps=4",
            "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.every=0",
            "trainer.checkpoint.export_final=false", f"output.dir={tmp_path}", f"output.name=replica{replica}",
            "diloco.enabled=true", "diloco.replicas=2", f"diloco.replica_id={replica}", f"diloco.store_url={store}",
            "diloco.inner_steps=2", "diloco.rollout_shards=true", "diloco.round_timeout_s=300",
            "diloco.poll_interval_s=0.1"]


def test_two_concurrent_rl_replicas_end_each_round_with_identical_weights(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    procs = []
    try:
        for replica in (0, 1):
            log = open(tmp_path / f"replica{replica}.log", "w")
            procs.append(subprocess.Popen(_replica_cmd(tmp_path, store, replica), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:  # a replica still running (the other failed, or the wait ran out): its process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=60)
    logs = [(tmp_path / f"replica{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)

    rounds = []
    for replica in (0, 1):
        records = [json.loads(line) for line in (tmp_path / f"replica{replica}" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2, 3, 4]
        assert [r.get("diloco/round") for r in train] == [None, 1, None, 2]
        assert all(train[i]["diloco/participants"] == 2 and train[i]["diloco/included"] == 1 for i in (1, 3))
        assert all(train[i]["diloco/bytes_up"] > 0 and train[i]["diloco/upload_s"] > 0 for i in (1, 3))
        rounds.append([train[1]["diloco/hash"], train[3]["diloco/hash"]])
    assert rounds[0] == rounds[1] and rounds[0][0] != rounds[0][1]

    reader = ShardReader(ObjectStore(store), "diloco")
    shards = list(reader.shards())
    assert reader.rejected == 0
    assert sorted((s.producer, s.manifest["step"]) for s in shards) == [
        (f"replica{r}", step) for r in (0, 1) for step in (1, 2, 3, 4)]
    for s in shards:
        assert len(s.records) == s.manifest["count"] > 0
        assert all(r["tokens"] and len(r["logprobs"]) == len(r["tokens"]) == len(r["mask"]) for r in s.records)
        assert all(r["version"] == s.manifest["step"] - 1 for r in s.records)


def test_a_killed_diloco_learner_rejoins_its_round_and_reproduces_the_uninterrupted_run(tiny_run_config, tmp_path,
                                                                                      caplog):
    """One replica (replicas = 1), inner_steps = 2, checkpoint at step 3 (inside round 2), learner
    SIGKILLed at step 4: it resumes from the step-3 checkpoint, rejoins the run at round 1 keeping
    the checkpoint's weights (its step-3 inner step still counts), and ends round 2 with the same
    weights as an uninterrupted run."""
    from meshrl.controller.metrics import read_metrics
    from meshrl.controller.train import make_run_dir, run_training

    def run(name, *extra):
        cfg = tiny_run_config(
            f"output.name={name}", "generator.backend=hf", "trainer.steps=5", "trainer.eval.every=0",
            "trainer.eval.at_start=false", "trainer.checkpoint.every=3", "trainer.checkpoint.export_final=false",
            "diloco.enabled=true", "diloco.replicas=1", "diloco.inner_steps=2",
            f"diloco.store_url=file://{tmp_path / name / 'store'}", *extra)
        run_dir = make_run_dir(cfg, overwrite=True)
        run_training(cfg, run_dir)
        return read_metrics(run_dir / "metrics.jsonl")

    clean = run("clean")
    with caplog.at_level(logging.INFO, logger="meshrl.controller.grpo"):
        faulty = run("killed", "faults.inject=[{mesh: learner, at_step: 4, action: kill, during: train, seconds: 0}]")
    joins = [r.getMessage() for r in caplog.records if "joined run" in r.getMessage()]
    assert len(joins) == 2 and "at round 0" in joins[0]
    assert "at round 1" in joins[1] and "the checkpoint's kept" in joins[1]
    faults = [r for r in faulty if r["kind"] == "fault"]
    assert len(faults) == 1 and (faults[0]["step"], faults[0]["resumed_from_step"]) == (4, 3)
    a, b = ([r for r in records if r["kind"] == "train"] for records in (clean, faulty))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r.get("diloco/round") for r in b] == [None, 1, None, 2, None]
    assert [r.get("diloco/hash") for r in a] == [r.get("diloco/hash") for r in b]
    for x, y in zip(a, b):
        assert x["train/loss"] == pytest.approx(y["train/loss"], abs=1e-6), x["step"]
