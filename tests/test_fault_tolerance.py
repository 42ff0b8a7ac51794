"""Fault tolerance with real processes: SIGKILLed and hung actors are replaced and the run
finishes every step (with one and two generator replicas); a slowed generator replica holds
neither the steps nor the weight sync, and follows every version once it is back; a killed learner
resumes from its checkpoint and reproduces an uninterrupted run; Ctrl-C leaves no orphan processes."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training

pytestmark = pytest.mark.monarch


def _run(cfg, session=None):
    run_dir = make_run_dir(cfg, overwrite=True)
    result = run_training(cfg, run_dir, session=session)
    records = read_metrics(run_dir / "metrics.jsonl")
    return result, records


def _train(records):
    return [r for r in records if r["kind"] == "train"]


def _faults(records):
    return [r for r in records if r["kind"] == "fault"]


# slow tier: ~35 s with one replica, ~80 s with two (hedging, then replacement) on 2 cores. The real
# vLLM engine: its replacement starts a new engine and pulls the run's weights into it
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_generator_killed_mid_generation_is_replaced_and_no_group_is_lost(tiny_run_config, replicas):
    cfg = tiny_run_config(
        "output.name=gen-kill", "generator.backend=vllm", "trainer.steps=4", "trainer.eval.every=0",
        "trainer.eval.at_start=false",
        "trainer.checkpoint.export_final=false", f"meshes.generator.procs={replicas}",
        'faults.inject=[{mesh: generator, at_step: 2, action: kill, during: generate, seconds: 0.3}]',
    )
    result, records = _run(cfg)
    train = _train(records)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert sum(r["batch/groups"] for r in train) == 4 * cfg.trainer.prompts_per_step
    assert [r["version"] for r in train] == [1, 2, 3, 4]
    faults = _faults(records)
    assert len(faults) == 1 and faults[0]["mesh"] == "generator"
    # one replica: the killed call fails and is recovered within step 2. Two: the survivor may take
    # over the dead replica's chunks (hedging) and finish step 2, and the dead one is then replaced
    # at its next call, the weight pull that ends step 2 or starts step 3
    assert faults[0]["step"] == 2 if replicas == 1 else faults[0]["step"] in (2, 3)
    assert train[-1]["faults/restarts/generator"] == 1
    assert result["steps"] == 4


@pytest.mark.slow
def test_rewarder_kill_and_hung_generator_are_both_survived(tiny_run_config, tiny_session):
    cfg = tiny_run_config(
        "output.name=multi-fault", "trainer.steps=3", "trainer.eval.every=0", "trainer.eval.at_start=false",
        "trainer.checkpoint.export_final=false", "generator.generate_timeout_s=8",
        "faults.inject=[{mesh: rewarder, at_step: 1, action: kill, during: score},"
        " {mesh: generator, at_step: 3, action: delay, endpoint: generate, seconds: 60}]",
    )
    _, records = _run(cfg, tiny_session)
    train = _train(records)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert sum(r["batch/groups"] for r in train) == 3 * cfg.trainer.prompts_per_step
    by_mesh = {f["mesh"]: f for f in _faults(records)}
    assert set(by_mesh) == {"rewarder", "generator"}
    assert "timed out" in by_mesh["generator"]["cause"]
    assert train[-1]["faults/restarts/rewarder"] == 1 and train[-1]["faults/restarts/generator"] == 1


@pytest.mark.slow
def test_a_slowed_generator_replica_holds_neither_the_steps_nor_the_sync(tiny_run_config):
    from meshrl.controller.runtime import Runtime

    delay = 8.0
    cfg = tiny_run_config(
        "trainer.steps=2", "trainer.eval.every=0", "meshes.generator.procs=2", "generator.generate_timeout_s=60",
        f"faults.inject=[{{mesh: generator, at_step: 1, action: delay, endpoint: generate, rank: 1, seconds: {delay}}}]")
    with Runtime(cfg) as rt:
        started = time.monotonic()
        steps = [rt.loop.step()[0] for _ in range(2)]
        took = time.monotonic() - started
        # replica 1 sleeps through both steps: replica 0 served every prompt (replica 1's chunk hedged)
        assert took < delay, took  # ~2 s on an idle machine; without hedging step 1 alone takes the delay
        assert [m["version"] for m in steps] == [1, 2]
        assert all(m["batch/groups"] == cfg.trainer.prompts_per_step for m in steps)
        assert [m["gen/replica_max_share"] for m in steps] == [1.0, 1.0]
        assert rt.supervisor.events == []  # nothing was replaced
        # once back, replica 1 has loaded the latest version before anything else (its pulls were queued)
        infos = rt.meshes["generator"].info.call().get(timeout=2 * delay)
        assert [i["version"] for i in infos.values()] == [2, 2]


@pytest.mark.parametrize("killed_at, checkpoint_every, resumed_from",
                         [(4, 2, 2), (2, 3, 0)], ids=["from-checkpoint", "before-the-first-checkpoint"])
@pytest.mark.slow  # each ~30 s on 2 cores
def test_killed_learner_resumes_and_reproduces_the_uninterrupted_run(tiny_run_config, tiny_session, killed_at,
                                                                     checkpoint_every, resumed_from, tmp_path):
    """The learner is killed during a step's training: the run goes back to its last checkpoint (or,
    before the first, starts over from step 0) and reproduces the uninterrupted run step for step."""
    common = ["trainer.steps=5", "trainer.eval.every=0", "trainer.eval.at_start=false",
              f"trainer.checkpoint.every={checkpoint_every}", "trainer.checkpoint.export_final=false"]
    _, clean = _run(tiny_run_config("output.name=clean", *common), tiny_session)
    _, faulty = _run(tiny_run_config(
        "output.name=learner-kill", *common,
        f"faults.inject=[{{mesh: learner, at_step: {killed_at}, action: kill, during: train, seconds: 0}}]"),
        tiny_session)
    faults = _faults(faulty)
    assert len(faults) == 1 and faults[0]["mesh"] == "learner"
    assert (faults[0]["step"], faults[0]["resumed_from_step"]) == (killed_at, resumed_from)
    a, b = _train(clean), _train(faulty)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6), x["step"]
        assert x["train/loss"] == pytest.approx(y["train/loss"], abs=1e-6), x["step"]
    # the trajectories of the redone steps replace the lost ones: the file is the uninterrupted run's
    kept = [[(r["step"], r["id"], r["tokens"]) for r in map(json.loads, open(tmp_path / name / "trajectories.jsonl"))]
            for name in ("clean", "learner-kill")]
    assert kept[0] == kept[1] and [s for s, _, _ in kept[0]] == [s for s in range(1, 6) for _ in range(16)]


@pytest.mark.slow  # ~70 s on 2 cores
def test_killed_rank_of_a_two_process_learner_resumes(tiny_run_config):
    """A data-parallel learner (2 processes, FSDP2) loses rank 1: both are replaced, the process
    group forms again, and training resumes from the checkpoint (DCP, written by both ranks)."""
    cfg = tiny_run_config(
        "output.name=dp-learner-kill", "meshes.learner.procs=2", "trainer.steps=3", "trainer.eval.every=0",
        "trainer.eval.at_start=false", "trainer.checkpoint.every=1", "trainer.checkpoint.export_final=false",
        "faults.inject=[{mesh: learner, rank: 1, at_step: 2, action: kill, during: train, seconds: 0}]")
    _, records = _run(cfg)
    faults = _faults(records)
    assert len(faults) == 1 and faults[0]["mesh"] == "learner"
    assert (faults[0]["step"], faults[0]["resumed_from_step"]) == (2, 1)
    assert [r["step"] for r in _train(records)] == [1, 2, 3]


@pytest.mark.slow
def test_ctrl_c_stops_every_mesh_and_leaves_no_orphans(tmp_path):
    from tests.conftest import TINY_RUN

    cmd = [sys.executable, "-m", "meshrl.cli", "train", *TINY_RUN, f"output.dir={tmp_path}", "trainer.steps=200"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    descendants = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "meshes ready" in line:
            descendants = psutil.Process(proc.pid).children(recursive=True)
            break
        assert time.monotonic() < deadline, "meshes never came up"
    assert len(descendants) >= 3, descendants
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    gone, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, [p.pid for p in alive]
