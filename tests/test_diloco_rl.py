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
    return [sys.executable, "-m", "meshrl.cli", "train", *TINY_RUN, "trainer.steps=4",
            "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.every=0",
            "trainer.checkpoint.export_final=false", f"output.dir={tmp_path}", f"output.name=replica{replica}",
            "diloco.enabled=true", "diloco.replicas=2", f"diloco.replica_id={replica}", f"diloco.store_url={store}",
            "diloco.inner_steps=2", "diloco.rollout_shards=true", "diloco.round_timeout_s=300",
            "diloco.poll_interval_s=0.1"]


def _run_jobs(tmp_path, commands: dict[str, list[str]], timeout=540) -> dict[str, list[dict]]:
    """Run the `meshrl train` jobs concurrently (each in its own process group, killed if still
    running at the end); their train records by name."""
    procs = {}
    try:
        for name, cmd in commands.items():
            with open(tmp_path / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        codes = {name: p.wait(timeout=timeout) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=60)
    logs = "\n".join((tmp_path / f"{name}.log").read_text()[-3000:] for name in commands)
    assert set(codes.values()) == {0}, logs
    return {name: [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                   if r["kind"] == "train"] for name in commands}


def test_two_concurrent_rl_replicas_end_each_round_with_identical_weights(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    jobs = _run_jobs(tmp_path, {f"replica{r}": _replica_cmd(tmp_path, store, r) for r in (0, 1)})

    rounds = []
    for replica in (0, 1):
        train = jobs[f"replica{replica}"]
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


def test_a_generation_job_feeds_a_learner_of_shards_and_follows_its_rounds(tmp_path):
    """Generation as a separate job: `diloco.role=generate` (generator + rewarder + a learner that
    only holds the run's weights) and `diloco.role=learn` (trains on its shards), two concurrent
    `meshrl train` jobs sharing only a file:// store. The learner is a one-replica DiLoCo run with
    outer_lr 1 and no momentum (each round's outer state is its own weights), so the generation job
    follows its weights every 2 steps."""
    store = f"file://{tmp_path / 'store'}"
    common = [*TINY_RUN, "trainer.steps=4", "trainer.eval.every=0", "trainer.eval.at_start=false",
              "trainer.checkpoint.every=0", "trainer.checkpoint.export_final=false", f"output.dir={tmp_path}",
              "diloco.enabled=true", "diloco.replicas=1", f"diloco.store_url={store}", "diloco.inner_steps=2",
              "diloco.round_timeout_s=300", "diloco.poll_interval_s=0.1"]
    train = [sys.executable, "-m", "meshrl.cli", "train", *common]
    jobs = _run_jobs(tmp_path, {
        "learn": [*train, "output.name=learn", "diloco.role=learn", "diloco.outer_lr=1", "diloco.outer_momentum=0",
                  "diloco.shard_wait_s=300"],
        # every group is written (the tiny model rarely scores, so most groups are uniform)
        "generate": [*train, "output.name=generate", "diloco.role=generate", "trainer.advantage.drop_uniform_groups=false"],
    })
    learn, generate = jobs["learn"], jobs["generate"]
    assert [r["step"] for r in learn] == [1, 2, 3, 4]
    assert all(r["shards/groups_read"] == 4 and r["batch/groups"] == 4 for r in learn)  # prompts_per_step groups
    assert learn[-1]["count/stale_dropped"] == 0  # the generation job kept within max_rounds_behind = 1
    assert [r.get("diloco/round") for r in learn] == [None, 1, None, 2]
    assert all("timing/generate_s" not in r for r in learn)  # it sampled nothing itself
    assert [r["shards/index"] for r in generate] == [0, 1, 2, 3]
    rounds = [generate[i]["diloco/round"] for i in (1, 3)]
    # it followed the learner's rounds, waiting at step 4 for round 4 / 2 - max_rounds_behind = 1
    assert rounds == sorted(rounds) and rounds[1] >= 1 and generate[3]["version"] == 4
    assert all("train/loss" not in r for r in generate)  # and trained nothing

    reader = ShardReader(ObjectStore(store), "diloco")
    shards = list(reader.shards())
    assert reader.rejected == 0 and [s.producer for s in shards] == ["gen0"] * 4
    assert sum(len({r["group"] for r in s.records}) for s in shards) == 16  # all trained by the learner


def test_a_killed_diloco_learner_rejoins_its_round_and_reproduces_the_uninterrupted_run(tiny_run_config, tmp_path,
                                                                                      caplog):
    """One replica (replicas = 1), inner_steps = 2, checkpoint at step 3 (inside round 2), learner
    SIGKILLed at step 4: it resumes from the step-3 checkpoint, rejoins the run at round 1 keeping
    the checkpoint's weights (its step-3 inner step still counts), and ends round 2 with the same
    weights as an uninterrupted run."""
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training

    def run(name, *extra):
        cfg = tiny_run_config(
            f"output.name={name}", "trainer.steps=5", "trainer.eval.every=0",
            "trainer.eval.at_start=false", "trainer.checkpoint.every=3", "trainer.checkpoint.export_final=false",
            "diloco.enabled=true", "diloco.replicas=1", "diloco.inner_steps=2",
            f"diloco.store_url=file://{tmp_path / name / 'store'}", *extra)
        run_dir = make_run_dir(cfg, overwrite=True)
        run_training(cfg, run_dir)
        return read_metrics(run_dir / "metrics.jsonl")

    clean = run("clean")
    caplog.clear()  # only the killed run's joins (an earlier test may have left meshrl's logger at INFO)
    with caplog.at_level(logging.INFO, logger="meshrl.controller.diloco_link"):
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


def test_a_generation_job_writes_teacher_pairs_and_a_learner_of_shards_trains_its_dpo_term_on_them(
        tiny_run_config, tmp_path):
    """The replay channel split across jobs: a generation job (`role: generate`, replay.beta > 0)
    replays its samples to three real HTTP teachers on loopback and writes the pairs that arrive
    into its shards; a learner of shards (`role: learn`, no teachers of its own) trains the DPO
    term on exactly those pairs."""
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training
    from meshrl.testing.fake_openai import FakeOpenAIServer

    store = f"file://{tmp_path / 'store'}"

    def run(name, *extra):
        cfg = tiny_run_config(f"output.name={name}", "trainer.steps=3", "trainer.eval.every=0",
                              "trainer.eval.at_start=false", "trainer.checkpoint.every=0",
                              "trainer.checkpoint.export_final=false", f"diloco.store_url={store}", "replay.beta=0.5",
                              *extra)
        run_dir = make_run_dir(cfg, overwrite=True)
        run_training(cfg, run_dir)
        return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]

    with FakeOpenAIServer({f"m{i}": "42" for i in range(3)}) as server:
        teachers = ", ".join(f"{{name: t{i}, base_url: '{server.base_url}', model: m{i}, timeout_s: 5}}" for i in range(3))
        generate = run("generate", "diloco.role=generate", "trainer.advantage.drop_uniform_groups=false",
                       "replay.select=all", "replay.pool.procs=1", f"replay.teachers.teachers=[{teachers}]")
        assert server.chat_requests("m0")  # the generation job's samples went to the teachers
    written = sum(r["shards/pairs_written"] for r in generate)
    assert written > 0 and all("train/loss" not in r for r in generate)
    records = [r for s in ShardReader(ObjectStore(store), "diloco").shards() for r in s.records]
    pairs = [r for r in records if r.get("kind") == "preference"]
    assert len(pairs) == written and all(p["chosen"] and p["rejected"] and p["prompt_tokens"] for p in pairs)

    learn = run("learn", "diloco.role=learn", "diloco.shard_wait_s=60", "replay.max_pairs_per_step=64")
    assert [r["shards/groups_read"] for r in learn] == [4, 4, 4]
    assert sum(r["shards/pairs_read"] for r in learn) == written  # every shard used up, each pair once
    assert learn[-1]["replay/dpo_items"] == written
    assert any(r["loss/replay_dpo"] > 0 for r in learn)
