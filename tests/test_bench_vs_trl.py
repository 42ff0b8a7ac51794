"""benchmarks/vs_trl.py places every meshrl arm on the GPU on a GPU host (fake device lists) and
on the CPU on a CPU host."""

import importlib.util
import sys
from pathlib import Path

import pytest

from meshrl.meshes.placement import plan_run

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "vs_trl.py")
vs_trl = sys.modules["bench_vs_trl"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)

MESHRL_ARMS = [arm for arm in vs_trl.ARMS if arm != "trl"]


def placed(arm, gpus):
    """{mesh: (devices by rank, shared mesh)} of ``arm`` on a host of ``gpus`` GPUs."""
    cfg = vs_trl.load_run_config(vs_trl.arm_overrides(arm, gpus))
    placement = plan_run(cfg, tuple(str(i) for i in range(gpus)), host="h")
    return {row.mesh: (placement.devices(row.mesh), row.shares) for row in placement.rows}


@pytest.mark.parametrize("arm", MESHRL_ARMS)
@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_meshrl_arm_trains_and_generates_on_gpus_on_a_gpu_host(arm, gpus):
    got = placed(arm, gpus)
    assert got["learner"] == ([(0,)], None)
    generator_devices, shares = got["generator"]
    assert len(generator_devices) == 1 and generator_devices[0]  # one replica, on a GPU
    assert shares == ("learner" if arm == "meshrl_colocated" else None)
    if arm != "meshrl_colocated":
        assert generator_devices == [(0,)] if gpus == 1 else [(1,)]


def test_on_one_gpu_the_separate_meshes_share_it_with_a_memory_share_each():
    cfg = vs_trl.load_run_config(vs_trl.arm_overrides("meshrl_async", 1))
    placement = plan_run(cfg, ("0",), host="h")
    assert placement.bootstrap("learner", 1).memory_fraction == 0.5
    assert placement.bootstrap("generator", 1).memory_fraction == 0.4
    assert cfg.trainer.max_steps_off_policy == 1


@pytest.mark.parametrize("arm", MESHRL_ARMS)
def test_on_a_cpu_host_every_arm_stays_on_the_cpu(arm):
    assert all(devices == [()] for devices, _ in placed(arm, 0).values())
