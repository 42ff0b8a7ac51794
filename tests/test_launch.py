"""The launch layer without Monarch processes: the `launch:` section's checks, flat ranks over
multi-host meshes, which hosts a spawn uses after losses, the reaper, run ids."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.launch import LaunchConfig
from meshrl.config.run import RunConfig
from meshrl.launch.run import run_id_for
from meshrl.meshes.hosts import HostLost, Hosts
from meshrl.meshes.ranks import coordinates


class _Extent:
    def __init__(self, **dims):
        self.labels, self.sizes = list(dims), list(dims.values())


def test_flat_ranks_are_row_major_over_hosts_then_procs():
    extent = _Extent(hosts=2, procs=3)
    assert [coordinates(extent, r) for r in (0, 2, 3, 5)] == [
        {"procs": 0, "hosts": 0}, {"procs": 2, "hosts": 0}, {"procs": 0, "hosts": 1}, {"procs": 2, "hosts": 1}]
    assert coordinates(_Extent(procs=4), 3) == {"procs": 3}
    with pytest.raises(IndexError, match="rank 6 is outside a mesh of 6 actors"):
        coordinates(extent, 6)


class _HostMesh:
    def __init__(self, name, hosts=None):
        self.name, self.hosts = name, hosts

    def slice(self, hosts):
        return _HostMesh(self.name, hosts)


def test_a_spawn_after_a_host_loss_uses_the_longest_run_of_surviving_hosts():
    cfg = LaunchConfig(launcher="process", hosts={"trainer": 1, "sampler": 4}, place={"generator": "sampler"})
    lost = {}
    hosts = Hosts({"trainer": _HostMesh("t"), "sampler": _HostMesh("s")}, cfg, probe=lambda: lost)
    assert hosts.group_of("generator") == "sampler" and hosts.group_of("learner") == "trainer"
    assert hosts.count("sampler") == 4 and hosts.host_mesh("sampler").hosts is None  # the whole mesh
    lost["sampler"] = {1}
    assert hosts.refresh() == [("sampler", 1)] and hosts.refresh() == []  # each loss reported once
    assert hosts.alive("sampler") == [0, 2, 3] and hosts.count("sampler") == 2
    assert hosts.host_mesh("sampler").hosts == slice(2, 4)
    assert hosts.events == [{"host_mesh": "sampler", "host": 1}]
    lost["trainer"] = {0}
    hosts.refresh()
    with pytest.raises(HostLost, match="every host of host mesh 'trainer' is lost"):
        hosts.host_mesh("trainer")


def test_on_host_loss_fail_stops_the_run_naming_the_host():
    cfg = LaunchConfig(launcher="process", hosts={"main": 2}, on_host_loss="fail")
    hosts = Hosts({"main": _HostMesh("m")}, cfg, probe=lambda: {"main": {1}})
    with pytest.raises(HostLost, match=r"^host 1 of host mesh 'main' is lost \(launch.on_host_loss = fail\)$"):
        hosts.refresh()


@pytest.mark.parametrize("override, message", [
    ("launch.hosts={main: 2}", "launch: hosts.main = 2: the local launcher has one host"),
    ("launch.place={generator: samplers}", "launch: place.generator = 'samplers': not a host mesh of launch.hosts"),
    ("launch.place={judge: main}", "launch: place.judge: not an actor mesh of a run"),
    ("launch.hosts={Main: 1}", "launch.hosts"),
    ("launch.launcher=ssh", "launch.launcher = 'ssh'"),
    ("launch.slurm.time_limit=2h", "launch.slurm.time_limit = '2h'"),
])
def test_bad_launch_sections_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_run_id_comes_from_the_config_or_the_run_directory(tmp_path):
    assert run_id_for(load_config(RunConfig, None, ["launch.run_id=exp-7"]), tmp_path / "whatever") == "exp-7"
    assert run_id_for(load_config(RunConfig, None, []), tmp_path / "Arithmetic 2026.11") == "arithmetic-2026-11"


def test_the_reaper_kills_the_workers_sessions_once_the_controller_is_gone():
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # a "worker" in a session of its own with a child of its own, as ProcessJob starts them
    worker = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                              start_new_session=True)
    reaper = subprocess.Popen([sys.executable, "-m", "meshrl.launch.reaper", str(controller.pid), "kill-sessions",
                               str(worker.pid)])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(worker.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [child] = psutil.Process(worker.pid).children()
        time.sleep(0.3)
        assert worker.poll() is None and reaper.poll() is None  # nothing happens while the controller runs
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
        reaper.wait(timeout=10)
        assert worker.wait(timeout=5) == -signal.SIGKILL
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        for p in (controller, worker, reaper):
            if p.poll() is None:
                p.kill()
                p.wait()
