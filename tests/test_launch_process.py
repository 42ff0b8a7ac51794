"""The process launcher for real: a multi-host job on this machine (Monarch's ProcessJob, each host
a worker process), the tiny model, the real vLLM engine. Weights cross a host boundary by RDMA, a
killed host worker is survived by moving its mesh to the surviving host, and no worker or actor
process outlives the job, not even a controller killed with SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.monarch


def _gone(pids, within_s):
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return not alive


@pytest.mark.slow
def test_two_host_grpo_run_survives_losing_a_generator_host_and_leaves_no_processes():
    cfg = load_config(RunConfig, None, TINY_RUN + [
        "launch.launcher=process", "launch.hosts={trainer: 1, sampler: 2}", "launch.place={generator: sampler}",
        "launch.host_loss_timeout_s=10", "meshes.rewarder.colocate_with=learner", "trainer.steps=1000",
        "generator.generate_timeout_s=15"])
    from meshrl.meshes.local import prepare_environment

    prepare_environment(cfg.meshes, cfg.launch)
    from meshrl.controller.runtime import Runtime
    from meshrl.launch import make_launcher

    launcher = make_launcher(cfg.launch, "two-hosts")
    hosts = launcher.start()
    everything = set(launcher.worker_pids().values())
    try:
        with Runtime(cfg, hosts) as rt:
            workers = launcher.worker_pids()
            generators = rt.meshes.pids["generator"]
            everything |= set(generators) | set(rt.meshes.pids["learner"])
            # one generator replica on each sampler host worker, the learner on the trainer's
            assert sorted(psutil.Process(p).ppid() for p in generators) == sorted(
                [workers[("sampler", 0)], workers[("sampler", 1)]])
            assert psutil.Process(rt.meshes.pids["learner"][0]).ppid() == workers[("trainer", 0)]

            record, _ = rt.loop.step()
            # the replicas pulled by RDMA: nothing is shared through memory across hosts. A replica
            # still busy with a late hedged duplicate pulls once it is done, outside the step's
            # record (a busy host), so the record counts one or both
            transports = {k: v for k, v in record.items() if k.startswith("sync/transport/")}
            assert rt.loop.version == 1 and list(transports) == ["sync/transport/rdma"], transports
            assert transports["sync/transport/rdma"] in (1, 2), transports

            killer = threading.Timer(0.5, os.kill, (workers[("sampler", 1)], signal.SIGKILL))
            killer.start()  # mid-step: generation or weight sync in flight
            record, trained = rt.loop.step()
            killer.join()
            assert rt.loop.version == 2 and len(trained) == 16
            # the loss is met by this step's calls, or, when hedging on the surviving replica
            # finished the step's generation first, by a later step's: once Monarch reports the
            # dead host (launch.host_loss_timeout_s), or once the chunk the dead replica never
            # answered is past its deadline (generator.generate_timeout_s). Tiny-model steps take
            # well under a second, so wait in steps for those timeouts, not for a number of steps
            deadline = time.monotonic() + 2 * (cfg.launch.host_loss_timeout_s + cfg.generator.generate_timeout_s)
            while not rt.hosts.events and time.monotonic() < deadline:
                record, _ = rt.loop.step()
            assert rt.hosts.events == [{"host_mesh": "sampler", "host": 1}]
            assert [e["mesh"] for e in rt.supervisor.events] == ["generator"]
            assert rt.meshes.procs_of("generator") == 1
            [survivor] = rt.meshes.pids["generator"]
            everything.add(survivor)
            assert psutil.Process(survivor).ppid() == workers[("sampler", 0)]

            before = rt.loop.version
            record, _ = rt.loop.step()  # the replacement pulls the new version across the host boundary
            assert rt.loop.version == before + 1 and record["sync/transport/rdma"] == 1
    finally:
        launcher.stop()
    assert _gone(everything, within_s=10), "a worker or actor process outlived the job"


CONTROLLER = textwrap.dedent("""
    import sys, time
    from meshrl.config.launch import LaunchConfig
    from meshrl.launch import make_launcher
    from meshrl.testing.mesh_actors import Sleeper

    launcher = make_launcher(LaunchConfig(launcher="process", hosts={"a": 1, "b": 1}), "reaped")
    hosts = launcher.start()
    procs = hosts.host_mesh("b").spawn_procs(per_host={"procs": 1})
    sleeper = procs.spawn("sleeper", Sleeper)
    pid = sleeper.info.call_one().get(timeout=60)["pid"]
    print(" ".join(map(str, [*launcher.worker_pids().values(), pid])), flush=True)
    time.sleep(120)
""")


@pytest.mark.slow  # ~7 s on 2 cores
def test_a_controller_killed_with_sigkill_leaves_no_workers():
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pids = [int(p) for p in controller.stdout.readline().split()]
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        assert _gone(pids, within_s=10), "host workers outlived their controller"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()


def test_a_job_gives_back_the_clients_log_forwarding_so_a_later_dead_mesh_stops_at_once():
    """Log forwarding is process-wide: while a job forwards its hosts' output, stopping a mesh whose
    process died waits for that process's logs until Monarch gives up (40 s, measured). Once the
    job has stopped, the client forwards as before it started, and such a stop takes a moment."""
    from monarch.actor import this_host
    from monarch.config import get_global_config

    from meshrl.config.launch import LaunchConfig
    from meshrl.launch import make_launcher
    from meshrl.meshes.supervision import install_fault_hook
    from meshrl.testing.mesh_actors import Sleeper

    install_fault_hook()  # the killed process below is an event, not the end of the test process
    before = get_global_config()["enable_log_forwarding"]
    launcher = make_launcher(LaunchConfig(launcher="process", hosts={"a": 1}), "forwarding")
    launcher.start()
    try:
        assert get_global_config()["enable_log_forwarding"] is True
    finally:
        launcher.stop()
    assert get_global_config()["enable_log_forwarding"] == before
    procs = this_host().spawn_procs(per_host={"procs": 1})
    pid = procs.spawn("sleeper", Sleeper).info.call_one().get(timeout=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _gone([pid], within_s=10)
    started = time.monotonic()
    procs.stop().get(timeout=30)
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_a_data_parallel_learner_that_loses_a_host_resumes_on_the_survivor(tmp_path):
    """DDP learner ranks on two trainer hosts; SIGKILL of the second host's worker after the
    step-2 checkpoint: the learner resumes from it with one rank and the run finishes."""
    from meshrl.controller.train import run_training
    from meshrl.launch.run import launched_hosts

    cfg = load_config(RunConfig, None, TINY_RUN + [
        "launch.launcher=process", "launch.hosts={trainer: 2, sampler: 1}",
        "launch.place={generator: sampler, rewarder: sampler}", "launch.host_loss_timeout_s=10",
        "learner.data_parallel=ddp", "trainer.steps=5", "trainer.checkpoint.every=2", "trainer.eval.every=0",
        "trainer.eval.at_start=false", "trainer.checkpoint.export_final=false"])
    killed = []

    def kill_second_trainer_host(worker, metrics_path):
        while not (metrics_path.exists() and metrics_path.read_text().count('"kind": "train"') >= 3):
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        killed.append(True)

    with launched_hosts(cfg, tmp_path) as hosts:
        # this process's host workers, by the ipc address ProcessJob gives each (.../<host mesh>_<index>)
        workers = {p.cmdline()[-1].split("/")[-1].split("'")[0]: p.pid for p in psutil.Process().children()
                   if "run_worker_loop_forever" in " ".join(p.cmdline())}
        assert sorted(workers) == ["sampler_0", "trainer_0", "trainer_1"] and hosts.count("trainer") == 2
        threading.Thread(target=kill_second_trainer_host, args=(workers["trainer_1"], tmp_path / "metrics.jsonl"),
                         daemon=True).start()
        result = run_training(cfg, tmp_path, hosts=hosts)
    assert killed and result["steps"] == 5
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    faults = [r for r in records if r["kind"] == "fault"]
    assert {f.get("action") for f in faults} == {"learner resumed from checkpoint",
                                                "host lost: its meshes move to the surviving hosts"}
    assert [f["resumed_from_step"] for f in faults if "resumed_from_step" in f] == [2]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert _gone(workers.values(), within_s=10)
