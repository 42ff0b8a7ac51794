"""GPU placement plans: automatic assignment order, explicit devices, co-location, and one-line
errors naming the config key for what cannot work (the CLI side is in test_cli_config.py, real
processes in test_mesh_group.py)."""

import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.run import RunConfig
from meshrl.meshes.placement import PlacementError, host_gpu_ids, plan_run

EIGHT = tuple(str(i) for i in range(8))


def placed(overrides, gpu_ids=EIGHT):
    """{mesh: [devices of rank 0, rank 1, ...]} of the run configured by ``overrides``."""
    placement = plan_run(load_config(RunConfig, None, overrides), gpu_ids, host="h")
    return {row.mesh: placement.devices(row.mesh) for row in placement.rows}


def test_automatic_order_is_learner_generator_rewarder_then_channels_around_explicit_devices():
    got = placed(["meshes.learner.procs=2", "meshes.learner.gpus_per_proc=2",
                  "meshes.generator.procs=2", "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[0,7]",
                  "meshes.rewarder.gpus_per_proc=1", "sdpo.alpha=0.1", "sdpo.teacher=mesh", "sdpo.mesh.gpus_per_proc=1"])
    assert got == {"learner": [(1, 2), (3, 4)], "generator": [(0,), (7,)], "rewarder": [(5,)], "sdpo_teacher": [(6,)]}


def test_co_located_meshes_see_their_host_meshes_gpus_and_cpu_meshes_see_none():
    cfg = load_config(RunConfig, None, ["meshes.generator.procs=2", "meshes.generator.gpus_per_proc=1",
                                        "sdpo.alpha=0.1", "sdpo.teacher=mesh", "sdpo.mesh.procs=2", "sdpo.mesh.colocate_with=generator",
                                        "meshes.rewarder.colocate_with=learner", "meshes.learner.gpus_per_proc=0"])
    placement = plan_run(cfg, EIGHT, host="h")
    assert placement.devices("sdpo_teacher") == placement.devices("generator") == [(0,), (1,)]
    assert [r.shares for r in placement.rows if r.mesh == "sdpo_teacher"] == ["generator", "generator"]
    assert placement.bootstrap("generator", 2).per_rank == ("0", "1")
    assert placement.bootstrap("learner", 1).per_rank == ("",)  # CPU-only on a GPU host: hide them all
    assert "sdpo_teacher  0     h     0        generator" in placement.table()


def test_a_host_without_gpus_needs_no_bootstrap_and_env_takes_the_rewarders_place():
    teachers = [{"name": n, "base_url": "http://127.0.0.1:1/v1", "model": "m"} for n in "ab"]
    cfg = load_config(RunConfig, None, ["task.kind=code", "replay.beta=0.5", f"replay.teachers.teachers={teachers}"])
    placement = plan_run(cfg, (), host="h")
    assert [r.mesh for r in placement.rows] == ["learner", "generator", "env", "teacher_replay", "teacher_replay",
                                               "replay_reference"]  # the replay pairs' reference actor
    assert placement.bootstrap("learner", 1) is None


def test_indices_map_through_the_controllers_own_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,GPU-abc,-1,7")
    assert host_gpu_ids() == ("4", "6", "GPU-abc")  # CUDA stops at the first invalid entry
    cfg = load_config(RunConfig, None, ["meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[2]",
                                        "meshes.learner.gpus_per_proc=1"])
    placement = plan_run(cfg, host="h")
    assert placement.bootstrap("generator", 1).per_rank == ("GPU-abc",)
    assert placement.bootstrap("learner", 1).per_rank == ("4",)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert host_gpu_ids() == ()


def test_learner_may_have_several_processes():
    assert placed(["meshes.learner.procs=4", "meshes.learner.gpus_per_proc=1"])["learner"] == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("overrides, gpu_ids, needle", [
    (["meshes.learner.gpus_per_proc=1", "meshes.learner.devices=[3]",
      "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[3]"], EIGHT,
     "meshes.generator.devices = [3]: GPU 3 is already meshes.learner's"),
    (["sdpo.alpha=0.1", "sdpo.teacher=mesh", "sdpo.mesh.gpus_per_proc=1", "sdpo.mesh.devices=[0]", "meshes.learner.gpus_per_proc=1",
      "meshes.learner.devices=[0]"], EIGHT, "sdpo.mesh.devices = [0]: GPU 0 is already meshes.learner's"),
    (["meshes.learner.procs=5", "meshes.learner.gpus_per_proc=1", "meshes.generator.procs=4",
      "meshes.generator.gpus_per_proc=1"], EIGHT,
     "meshes.generator.gpus_per_proc = 1: 4 process(es) need 4 GPU(s) but only 3 of the host's 8 are free"),
    (["meshes.generator.gpus_per_proc=1"], (), "meshes.generator.gpus_per_proc = 1: 1 process(es) need 1 GPU(s) but the host has none"),
    (["meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[8]"], EIGHT,
     "meshes.generator.devices = [8]: GPU 8 is not on the host (it has GPUs 0-7)"),
    (["sdpo.alpha=0.1", "sdpo.teacher=mesh", "sdpo.mesh.procs=2", "sdpo.mesh.colocate_with=generator"], EIGHT,
     "sdpo.mesh.procs = 2: must equal meshes.generator.procs = 1 to co-locate"),
    (["sdpo.alpha=0.1", "sdpo.teacher=mesh", "sdpo.mesh.colocate_with=rewarder", "meshes.rewarder.colocate_with=learner"], EIGHT,
     "sdpo.mesh.colocate_with = 'rewarder': meshes.rewarder is itself co-located (with learner)"),
    (["task.kind=code", "meshes.generator.colocate_with=rewarder"], EIGHT,
     "meshes.generator.colocate_with = 'rewarder': this run spawns no rewarder mesh"),
])
def test_impossible_placements_are_one_line_naming_the_key(overrides, gpu_ids, needle):
    cfg = load_config(RunConfig, None, overrides)
    with pytest.raises(PlacementError) as err:
        plan_run(cfg, gpu_ids, host="h")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (["meshes.generator.procs=2", "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[0,1,2]"],
     "meshes.generator.devices = [0, 1, 2] (list): expected procs * gpus_per_proc = 2 * 1 = 2 GPU indices, got 3"),
    (["meshes.generator.gpus_per_proc=0", "meshes.generator.devices=[1]"],
     "meshes.generator.devices = [1] (list): expected procs * gpus_per_proc = 1 * 0"),
    (["meshes.generator.procs=2", "meshes.generator.gpus_per_proc=1", "meshes.generator.devices=[4,4]"],
     "meshes.generator.devices = [4, 4] (list): expected distinct GPU indices, 4 appears more than once"),
    (["meshes.rewarder.colocate_with=learner", "meshes.rewarder.devices=[1]"],
     "meshes.rewarder.devices = [1] (list): expected no GPUs of its own: it shares learner's processes"),
    (["meshes.rewarder.colocate_with=learner", "meshes.rewarder.gpus_per_proc=1"],
     "meshes.rewarder.gpus_per_proc = 1 (int): expected no GPUs of its own"),
    (["sdpo.mesh.colocate_with=generator", "sdpo.mesh.devices=[0]"], "sdpo.mesh.devices = [0] (list): expected no GPUs"),
])
def test_bad_device_settings_fail_when_the_config_loads(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_two_meshes_share_a_gpu_with_a_memory_share_each():
    cfg = load_config(RunConfig, None, [
        "meshes.learner.devices=[0]", "meshes.learner.gpu_memory_fraction=0.55",
        "meshes.generator.devices=[0]", "meshes.generator.gpu_memory_fraction=0.4", "trainer.max_steps_off_policy=1"])
    placement = plan_run(cfg, ("0",), host="h")
    assert placement.devices("learner") == placement.devices("generator") == [(0,)]
    learner, generator = placement.bootstrap("learner", 1), placement.bootstrap("generator", 1)
    assert (learner.per_rank, learner.memory_fraction) == (("0",), 0.55)
    assert (generator.per_rank, generator.memory_fraction) == (("0",), 0.4)
    assert placement.bootstrap("rewarder", 1).memory_fraction is None
    assert "generator  0     h     0 (40%)  -" in placement.table()


@pytest.mark.parametrize("fractions, needle", [
    ((None, "0.4"), "meshes.generator.devices = [0]: GPU 0 is already meshes.learner's (meshes share a GPU co-located "
                    "or with a gpu_memory_fraction each; meshes.learner has none)"),
    (("0.7", "0.4"), "meshes.generator.gpu_memory_fraction = 0.4: the meshes on GPU 0 (meshes.learner, "
                     "meshes.generator) would take 1.10 of its memory"),
])
def test_a_shared_gpu_needs_a_memory_share_per_mesh_within_the_whole(fractions, needle):
    overrides = ["meshes.learner.devices=[0]", "meshes.generator.devices=[0]"]
    overrides += [f"meshes.{m}.gpu_memory_fraction={f}" for m, f in zip(("learner", "generator"), fractions) if f]
    with pytest.raises(PlacementError) as err:
        plan_run(load_config(RunConfig, None, overrides), ("0",), host="h")
    assert str(err.value) == needle
