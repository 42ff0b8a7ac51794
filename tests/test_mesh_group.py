"""MeshGroup with real Monarch processes: a hung actor's process is killed when its mesh is
replaced (it must not keep its memory and cores while the replacement starts), a killed process is
seen by `dead_process`, and each process sees only the GPUs of its placement, also after a respawn."""

import time

import psutil
import pytest
from meshrl.config.meshes import MeshesConfig, MeshSpec
from meshrl.config.launch import LaunchConfig
from meshrl.meshes.hosts import Hosts
from meshrl.meshes.local import prepare_environment
from meshrl.meshes.group import MeshGroup
from meshrl.meshes.placement import Slot, plan
from meshrl.meshes.supervision import install_fault_hook
from meshrl.testing.mesh_actors import EnvProbe, Sleeper

pytestmark = pytest.mark.monarch


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # ~7 s on 2 cores
def test_respawn_kills_a_hung_process_and_dead_process_sees_a_kill():
    cfg = MeshesConfig(spawn_timeout_s=60)
    prepare_environment(cfg)
    install_fault_hook()
    group = MeshGroup(cfg, Hosts.local(LaunchConfig()))
    try:
        group.add_mesh("sleepy", 1)
        group.spawn("sleepy", Sleeper)
        group.wait_ready(["sleepy"])
        [hung] = group.pids["sleepy"]
        assert group.infos["sleepy"][0]["host"]
        group["sleepy"].sleep.call(600)  # never answered
        time.sleep(0.5)
        assert group.dead_process("sleepy") is None

        group.respawn("sleepy")
        assert _gone(hung, within_s=2.0), "the hung process outlived its replacement's start"
        [fresh] = group.pids["sleepy"]
        assert fresh != hung and group.dead_process("sleepy") is None

        group.kill("sleepy")
        deadline = time.monotonic() + 2.0
        while group.dead_process("sleepy") is None:
            assert time.monotonic() < deadline, "a SIGKILLed process was not noticed"
            time.sleep(0.05)
        assert str(fresh) in group.dead_process("sleepy")
    finally:
        group.stop(timeout_s=30)


@pytest.mark.slow  # ~14 s on 2 cores
def test_each_process_sees_only_its_placed_gpus_also_after_a_respawn():
    """The bootstrap sets CUDA_VISIBLE_DEVICES per rank in real processes (no CUDA is needed to
    read it back): host GPUs 2 and 5 for a 2-process mesh, none for a CPU-only mesh on a GPU host."""
    cfg = MeshesConfig(spawn_timeout_s=60)
    prepare_environment(cfg)
    install_fault_hook()
    placement = plan([Slot("probe", "probe", MeshSpec(procs=2, gpus_per_proc=1, devices=[2, 5])),
                      Slot("cpu", "cpu", MeshSpec())], gpu_ids=tuple(str(i) for i in range(8)), host="here")
    group = MeshGroup(cfg, Hosts.local(LaunchConfig()), placement)

    def seen(name):
        return list(group[name].getenv.call("CUDA_VISIBLE_DEVICES").get(timeout=60).values())

    try:
        group.add_mesh("probe", 2)
        group.add_mesh("cpu", 1)
        group.spawn("probe", EnvProbe)
        group.spawn("cpu", EnvProbe)
        group.wait_ready()
        assert seen("probe") == ["2", "5"]
        assert seen("cpu") == [""]
        assert list(group["probe"].getenv.call("CUDA_DEVICE_ORDER").get(timeout=60).values()) == ["PCI_BUS_ID"] * 2
        before = group.pids["probe"]

        group.respawn("probe")
        assert set(group.pids["probe"]).isdisjoint(before)
        assert seen("probe") == ["2", "5"]
    finally:
        group.stop(timeout_s=30)
