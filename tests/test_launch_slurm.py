"""SLURM launcher: the batch script a config yields, the queue readers and host-loss mapping
(fast), and a real single-node SLURM cluster on this machine (`scripts/slurm-local.sh`; slow).

One machine is one SLURM node, so the real tests run every host mesh on a single node
(`launch.hosts` summing to 1); splitting an allocation over several host meshes is covered by the
batch-script tests only.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.run import RunConfig
from meshrl.launch import LaunchError, make_launcher
from meshrl.launch import slurm as slurm_launch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm-local.sh"


def _launcher(tmp_path, *overrides, run_id="run7"):
    cfg = load_config(RunConfig, None, ["launch.launcher=slurm", *overrides])
    return make_launcher(cfg.launch, run_id, tmp_path / "run")


def test_batch_script_follows_the_config(tmp_path, monkeypatch):
    from monarch.config import get_global_config

    monkeypatch.setenv("HF_HOME", "/shared/hf-cache")
    monkeypatch.delenv("MESHRL_MODELS_DIR", raising=False)
    transport = get_global_config()["default_transport"]
    launcher = _launcher(
        tmp_path, "launch.hosts={trainers: 2, samplers: 1}", "launch.slurm.partition=gpu",
        "launch.slurm.account=rl-team", "launch.slurm.qos=high", "launch.slurm.time_limit=02:00:00",
        "launch.slurm.gpus_per_node=8", "launch.slurm.cpus_per_task=16", "launch.slurm.mem=64G",
        "launch.slurm.python_exe=/opt/env/bin/python", "launch.slurm.port=23456",
        "launch.slurm.extra_args=[--constraint=h100]")
    text = launcher.dry_run(tmp_path / "out")
    script = (tmp_path / "out" / "sbatch.sh").read_text()
    assert text.startswith("# launcher slurm, run run7") and text.endswith(script)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=3", "--ntasks-per-node=1", "--partition=gpu", "--account=rl-team", "--qos=high",
                      "--time=02:00:00", "--gpus-per-node=8", "--cpus-per-task=16", "--mem=64G", "--exclusive",
                      "--constraint=h100", "--no-requeue"):
        assert f"#SBATCH {directive}" in lines, directive
    assert re.fullmatch(r"#SBATCH --job-name=meshrl-run7_\d+", lines[1])
    assert f"#SBATCH --output={tmp_path}/run/slurm/slurm_%j_meshrl-run7_" in script
    # the worker environment: names travel with sbatch's environment, values are not written down
    export = next(line for line in lines if line.startswith("#SBATCH --export="))
    assert export.split("=", 1)[1].split(",")[0] == "ALL"
    assert "HF_HOME" in export.split(",") and export.endswith(",MESHRL_RUN_ID=run7")
    assert "/shared/hf-cache" not in script
    assert any(line.startswith("srun /opt/env/bin/python -c ") and ":23456" in line for line in lines)
    assert not (tmp_path / "run").exists()  # nothing submitted, no log directory made
    assert get_global_config()["default_transport"] == transport  # SlurmJob's process-wide setting undone


def test_defaults_use_this_interpreter_and_cluster_defaults(tmp_path):
    script = _launcher(tmp_path, "launch.slurm.exclusive=false").batch_script()
    assert f"srun {sys.executable} -c " in script
    assert "#SBATCH --nodes=1" in script
    for option in ("--partition", "--account", "--qos", "--time", "--gpus-per-node", "--mem", "--exclusive"):
        assert f"#SBATCH {option}" not in script, option


@pytest.mark.parametrize("override, key", [
    ("launch.slurm.time_limit=2h", "launch.slurm.time_limit"),
    ("launch.slurm.mem=lots", "launch.slurm.mem"),
    ("launch.slurm.extra_args=[constraint=h100]", "launch.slurm.extra_args"),
    ("launch.slurm.extra_args=[--export=NONE]", "launch.slurm.extra_args"),
    ("launch.slurm.controller_address=10.0.0.5", "launch.slurm.controller_address"),
    ("launch.slurm.gpus_per_node=-1", "launch.slurm.gpus_per_node"),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, ["launch.launcher=slurm", override])
    assert key in str(e.value) and "\n" not in str(e.value)


def test_sbatch_export_in_the_environment_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    with pytest.raises(LaunchError, match="SBATCH_EXPORT is set"):
        _launcher(tmp_path).dry_run()


def test_a_hostname_on_loopback_needs_a_controller_address(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_launch.socket, "gethostname", lambda: "localhost")
    launcher = _launcher(tmp_path)
    with pytest.raises(LaunchError, match="launch.slurm.controller_address") as e:
        launcher.start()
    assert "\n" not in str(e.value) and launcher.job_id() is None


def _squeue(jobs):
    return json.dumps({"jobs": jobs})


def test_queue_reader_understands_old_and_new_squeue_json(monkeypatch):
    old = [  # SLURM 22.05: every job listed whatever --job says, state a string, nodes as text
        {"job_id": 3, "job_state": "CANCELLED", "job_resources": {}},
        {"job_id": 4, "job_state": "RUNNING",
         "job_resources": {"nodes": "n[1-2]", "allocated_nodes": [{"nodename": "n1"}, {"nodename": "n2"}]}}]
    new = [{"job_id": 4, "job_state": ["RUNNING"],
            "job_resources": {"nodes": {"allocation": [{"name": "n1"}, {"name": "n2"}]}}}]
    for answer in (old, new):
        monkeypatch.setattr(slurm_launch, "slurm_command", lambda *a, answer=answer: _squeue(answer))
        info = slurm_launch.job_info("4")
        assert info["job_state"] == ["RUNNING"] and slurm_launch.allocated_nodes(info) == ["n1", "n2"]
        assert slurm_launch.job_info("5") is None


def test_lost_hosts_maps_down_and_released_nodes_to_host_meshes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    launcher = _launcher(tmp_path, "launch.hosts={trainers: 2, samplers: 2}")
    launcher._job = SimpleNamespace(_slurm_job_id="4", _all_hostnames=["n1", "n2", "n3", "n4"])
    still = [{"job_id": 4, "job_state": "RUNNING",
              "job_resources": {"allocated_nodes": [{"nodename": n} for n in ("n1", "n2", "n3")]}}]
    answers = {"squeue": _squeue(still), "sinfo": "n1 allocated\nn2 down*\nn3 allocated*\nn4 idle\n"}
    monkeypatch.setattr(slurm_launch, "slurm_command", lambda *args: answers[args[0]])
    assert launcher.lost_hosts() == {"trainers": {1}, "samplers": {0, 1}}
    answers["squeue"] = _squeue([])  # the job ended: every host is gone
    assert launcher.lost_hosts() == {"trainers": {0, 1}, "samplers": {0, 1}}

    def unreachable(*args):
        raise LaunchError("squeue: no answer in 30 s")

    monkeypatch.setattr(slurm_launch, "slurm_command", unreachable)
    assert launcher.lost_hosts() == {}  # no evidence, no loss
    launcher._job = None


# --- a real single-node SLURM cluster -------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_cluster():
    """This machine as a one-node SLURM cluster (started here, and stopped again, unless it was
    already running)."""
    if os.geteuid() != 0:
        pytest.skip("scripts/slurm-local.sh needs root to install and run the SLURM daemons")
    if subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, timeout=60).returncode == 0:
        yield
        return
    started = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    assert started.returncode == 0, started.stderr
    yield
    subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def _controller_address() -> list[str]:
    """`launch.slurm.controller_address` for this machine when its hostname resolves only to
    loopback (as in this container), from its first non-loopback IPv4 interface."""
    if slurm_launch._hostname_problem() is None:
        return []
    import socket

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith(("127.", "169.254.")):
                return [f"launch.slurm.controller_address=tcp://{a.address}:0"]
    pytest.skip("this machine has no non-loopback IPv4 address for the controller")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_config(tmp_path, *overrides):
    return load_config(RunConfig, None, [
        "launch.launcher=slurm", "launch.slurm.time_limit=00:15:00", "launch.slurm.job_start_timeout_s=120",
        f"launch.slurm.port={_free_port()}", *_controller_address(), f"output.dir={tmp_path}", *overrides])


def _job_processes(job_id: str) -> list[int]:
    """Processes whose environment names SLURM job ``job_id`` (its workers and their actors)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture
def monarch_config():
    """Monarch's process-wide settings as they were before the test (SlurmJob changes the transport)."""
    from monarch.config import configured

    with configured():
        yield


def _probe_class():
    from monarch.actor import Actor, endpoint

    class Probe(Actor):
        @endpoint
        def env(self) -> dict:
            return {name: os.environ.get(name) for name in ("SLURM_JOB_ID", "MESHRL_RUN_ID", "HF_HUB_OFFLINE")}

    return Probe


@pytest.mark.slow
@pytest.mark.monarch
def test_real_job_runs_actors_inside_the_allocation(slurm_cluster, monarch_config, tmp_path):
    launcher = make_launcher(_slurm_config(tmp_path).launch, "slurm-e2e", tmp_path)
    t0 = time.monotonic()
    hosts = launcher.start()
    job_id = launcher.job_id()
    try:
        procs = hosts.host_mesh("main").spawn_procs(per_host={"procs": 1})
        env = procs.spawn("probe", _probe_class()).env.call_one().get(timeout=120)
        print(f"sbatch to first answer {time.monotonic() - t0:.1f} s")
        assert env == {"SLURM_JOB_ID": job_id, "MESHRL_RUN_ID": "slurm-e2e", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE")}
        assert _job_processes(job_id)
        assert launcher.lost_hosts() == {}
    finally:
        launcher.stop()
    assert not slurm_launch.in_queue(job_id)
    assert _job_processes(job_id) == []
    assert list((tmp_path / "slurm").glob(f"slurm_{job_id}_meshrl-slurm-e2e_*.out"))


@pytest.mark.slow
@pytest.mark.monarch
def test_real_node_down_is_a_lost_host_and_the_job_is_not_requeued(slurm_cluster, monarch_config, tmp_path):
    import socket

    launcher = make_launcher(_slurm_config(tmp_path).launch, "slurm-down", tmp_path)
    launcher.start()
    job_id, node = launcher.job_id(), socket.gethostname()
    try:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=meshrl-test"],
                       check=True, timeout=30)
        assert launcher.lost_hosts() == {"main": {0}}
        deadline = time.monotonic() + 60
        while slurm_launch.in_queue(job_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not slurm_launch.in_queue(job_id)  # ended, not requeued (--no-requeue)
    finally:
        # (the node may be back already: ReturnToService=2 in slurm-local.sh)
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)
        launcher.stop()
    assert _job_processes(job_id) == []


@pytest.mark.slow
@pytest.mark.monarch
def test_real_job_is_cancelled_when_the_controller_is_killed(slurm_cluster, tmp_path):
    code = (
        "import sys; from meshrl.config.base import load_config; from meshrl.config.run import RunConfig\n"
        "from meshrl.launch import make_launcher\n"
        "cfg = load_config(RunConfig, None, sys.argv[1:])\n"
        "launcher = make_launcher(cfg.launch, 'slurm-orphan', None)\n"
        "launcher.start(); print(launcher.job_id(), flush=True); sys.stdin.read()\n")
    overrides = ["launch.launcher=slurm", f"launch.slurm.log_dir={tmp_path}", f"launch.slurm.port={_free_port()}",
                 *_controller_address()]
    controller = subprocess.Popen([sys.executable, "-c", code, *overrides], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        job_id = controller.stdout.readline().strip()
        assert job_id.isdigit()
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=30)
    deadline = time.monotonic() + 60
    while slurm_launch.in_queue(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not slurm_launch.in_queue(job_id)
    assert _job_processes(job_id) == []


def _run_processes(run_id: str) -> list[int]:
    """Processes whose environment carries run ``run_id`` (MESHRL_RUN_ID), other than this one."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get("MESHRL_RUN_ID") == run_id:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow
@pytest.mark.monarch
def test_real_grpo_step_through_meshrl_launch_slurm(slurm_cluster, monarch_config, tmp_path):
    """`meshrl launch slurm`'s path (launch_main): learner, generator and rewarder meshes inside
    the SLURM job on the tiny model, one GRPO step, then the job cancelled."""
    from meshrl.launch.run import launch_main
    from tests.conftest import TINY_RUN

    cfg = _slurm_config(tmp_path, *TINY_RUN, "trainer.steps=1", "trainer.eval.size=1", "trainer.checkpoint.export_final=false",
                        "launch.run_id=slurm-grpo", "output.name=grpo")
    assert launch_main(cfg) == 0
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 and "train/loss" in r for r in records)
    assert list((tmp_path / "grpo" / "slurm").glob("slurm_*_meshrl-slurm-grpo_*.out"))
    assert _run_processes("slurm-grpo") == []
