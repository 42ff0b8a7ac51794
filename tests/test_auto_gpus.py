"""`gpus_per_proc: auto` (the default): the layout chosen for hosts of 0, 1, 2 and 8 GPUs (fake
device lists), explicit settings winning over it, and `meshrl train --dry-run` / `meshrl plan`
printing the choice and why."""

import pytest
import yaml

from meshrl.cli import default_config_path, main
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.meshes.auto_gpus import resolve_gpus
from meshrl.meshes.placement import plan_run


def gpus(n):
    return tuple(str(i) for i in range(n))


def layout(overrides=(), n=0):
    """{mesh: (devices by rank, mesh shared)} of the default job plus ``overrides`` on ``n`` GPUs."""
    placement = plan_run(load_config(RunConfig, default_config_path(), list(overrides)), gpus(n), host="h")
    return {row.mesh: (placement.devices(row.mesh), row.shares) for row in placement.rows}


CPU = {"learner": ([()], None), "generator": ([()], None), "rewarder": ([()], None)}


def test_a_cpu_host_keeps_every_mesh_on_the_cpu_as_an_explicit_zero_does():
    assert layout(n=0) == CPU
    explicit = [f"meshes.{m}.gpus_per_proc=0" for m in ("learner", "generator", "rewarder")]
    assert layout(explicit, n=0) == layout(explicit, n=8) == CPU


def test_one_gpu_puts_the_learner_on_it_and_the_generator_in_its_processes():
    assert layout(n=1) == {"learner": ([(0,)], None), "generator": ([(0,)], "learner"), "rewarder": ([()], None)}
    choice = resolve_gpus(load_config(RunConfig, default_config_path()), 1)
    assert choice.cfg.meshes.generator.colocate_with == "learner"  # the processes are spawned from this
    assert any("co-located" in line for line in choice.reasons)


@pytest.mark.parametrize("overrides, colocate, why", [
    ([], False, "this front end gives generators processes of their own"),
    (["trainer.max_steps_off_policy=1"], True, "trainer.max_steps_off_policy = 1"),
    (["trainer.num_substeps=2"], True, "trainer.num_substeps = 2"),
])
def test_one_gpu_without_co_location_is_shared_by_two_processes_with_a_memory_share_each(overrides, colocate, why):
    choice = resolve_gpus(load_config(RunConfig, default_config_path(), overrides), 1, colocate=colocate)
    learner, generator = choice.cfg.meshes.learner, choice.cfg.meshes.generator
    assert generator.colocate_with is None
    assert (learner.devices, learner.gpu_memory_fraction, generator.devices, generator.gpu_memory_fraction) == \
        ([0], 0.5, [0], 0.4)
    assert (f"meshes.generator: its own process on the learner's GPU 0, 40% of its memory against the learner's "
            f"50% (not co-located: {why})") in choice.reasons
    placement = plan_run(choice.cfg, gpus(1), host="h")
    assert placement.bootstrap("generator", 1).memory_fraction == 0.4


def test_an_explicit_learner_is_not_given_a_memory_share():
    cfg = load_config(RunConfig, default_config_path(), ["trainer.max_steps_off_policy=1",
                                                         "meshes.learner.gpus_per_proc=1"])
    choice = resolve_gpus(cfg, 1)
    assert choice.cfg.meshes.learner.gpu_memory_fraction is None
    assert choice.cfg.meshes.generator.gpus_per_proc == 0  # no GPU left, and it may not co-locate
    assert "meshes.generator: on the CPU (co-location is ruled out)" in choice.reasons


def test_two_gpus_give_learner_and_generator_one_each():
    assert layout(n=2) == {"learner": ([(0,)], None), "generator": ([(1,)], None), "rewarder": ([()], None)}


def test_eight_gpus_give_the_learner_gpu_0_and_a_generator_replica_each_other_gpu():
    got = layout(n=8)
    assert got["learner"] == ([(0,)], None)
    assert got["generator"] == ([(i,) for i in range(1, 8)], None)
    assert got["rewarder"] == ([()], None)


@pytest.mark.parametrize("overrides, expected", [
    (["meshes.generator.procs=2"], {"learner": [(0,)], "generator": [(1,), (2,)]}),
    (["meshes.learner.procs=3"], {"learner": [(0,), (1,), (2,)], "generator": [(i,) for i in range(3, 8)]}),
    (["meshes.learner.gpus_per_proc=0"], {"learner": [()], "generator": [(i,) for i in range(8)]}),
    (["meshes.learner.gpus_per_proc=2"], {"learner": [(0, 1)], "generator": [(i,) for i in range(2, 8)]}),
    (["meshes.generator.colocate_with=learner"], {"learner": [(0,)], "generator": [(0,)]}),
    (["meshes.generator.devices=[5]"], {"learner": [(0,)], "generator": [(5,)]}),
    (["meshes.rewarder.gpus_per_proc=1"], {"learner": [(0,)], "generator": [(i,) for i in range(1, 7)],
                                           "rewarder": [(7,)]}),
])
def test_an_explicit_setting_wins_and_auto_fills_around_it(overrides, expected):
    got = layout(overrides, n=8)
    assert {m: got[m][0] for m in expected} == expected


def test_a_learner_that_does_not_fit_stays_on_the_cpu_and_says_why():
    choice = resolve_gpus(load_config(RunConfig, default_config_path(), ["meshes.learner.procs=2"]), 1)
    assert choice.cfg.meshes.learner.gpus_per_proc == 0
    assert "meshes.learner: on the CPU (2 process(es) need a GPU each, 1 free)" in choice.reasons
    assert choice.cfg.meshes.generator.gpus_per_proc == 1  # the GPU the learner could not use


def test_dry_run_plans_the_gpus_without_any_placement_setting(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # this host's GPUs, as the controller sees them
    assert main(["train", "--dry-run"]) == 0
    out = capsys.readouterr().out
    body = yaml.safe_load(out)
    assert body["meshes"]["learner"]["gpus_per_proc"] == body["meshes"]["generator"]["gpus_per_proc"] == 1
    assert "# placement on this host (2 GPUs found)" in out
    assert "#   why: meshes.generator: 1 replica(s), one per GPU the learner leaves" in out
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith(("# learner", "# generator"))]
    assert [(mesh, devices) for mesh, _, _, devices, _ in rows] == [("learner", "0"), ("generator", "1")]


def test_plan_on_a_cpu_host_prints_the_cpu_table(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "placement on this host (0 GPUs found)"
    assert "  why: meshes.learner: on the CPU (no GPU found)" in out
    assert [line.split()[3] for line in out if line.startswith(("learner", "generator", "rewarder"))] == ["cpu"] * 3


def test_front_ends_resolve_auto_for_the_gpus_this_host_offers(monkeypatch):
    from meshrl.meshes.placement import resolve_run

    cfg = load_config(RunConfig, default_config_path())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert resolve_run(cfg).cfg.meshes.generator.colocate_with == "learner"  # what MeshSession and Runtime spawn
    assert resolve_run(cfg, colocate=False).cfg.meshes.generator.devices == [0]  # the API's: a process of its own
    resolved = resolve_run(cfg).cfg
    assert resolve_run(resolved).cfg == resolved  # a decided config (a run's config.yaml) stays as it is
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_run(cfg).cfg.meshes.learner.gpus_per_proc == 0
