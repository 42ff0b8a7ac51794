"""MeshSession, the one bring-up under every front end: whatever way a bring-up ends, every process
it started is stopped, and what was registered to close does close, newest first."""

import time
from pathlib import Path

import psutil
import pytest

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.meshes.group import MeshSpawnError
from meshrl.meshes.session import MeshSession
from meshrl.testing.mesh_actors import FailsInInit, Sleeper

pytestmark = pytest.mark.monarch
PLUGIN = str(Path(__file__).resolve().parent / "plugins" / "failing_term.py")


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _all_gone(pids: set[int], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # ~6 s on 2 cores
def test_a_mesh_failing_its_setup_stops_every_mesh_and_the_closers_run_newest_first():
    before = _children()
    closed = []
    with pytest.raises(MeshSpawnError, match="mesh 'broken' failed during setup"):
        with MeshSession(load_config(RunConfig, None, ["meshes.spawn_timeout_s=60"])) as session:
            session.on_close(lambda: closed.append("first"))
            session.on_close(lambda: 1 / 0)  # a failing closer does not stop the others or the meshes
            session.on_close(lambda: closed.append("last"))
            session.spawn("healthy", Sleeper, procs=1)
            session.spawn("broken", FailsInInit, procs=1)
            try:
                session.wait_ready()
            finally:
                started = _children() - before
    assert closed == ["last", "first"]
    assert started and _all_gone(started), "a process of the session outlived it"


@pytest.mark.slow  # ~12 s on 2 cores
def test_a_run_whose_bring_up_fails_after_spawning_leaves_no_process(tiny_run_config):
    from meshrl.controller.runtime import Runtime
    from meshrl.plugins import import_plugins

    [plugin] = import_plugins([PLUGIN])
    plugin.SEEN.clear()
    cfg = tiny_run_config(f"plugins=[{PLUGIN}]", "trainer.terms=[{name: fails_to_build}]")
    with pytest.raises(RuntimeError, match="this term cannot be built"):
        Runtime(cfg)
    # the learner, generator and rewarder were up when the term failed
    assert sorted(plugin.SEEN) == ["generator", "learner", "rewarder"]
    assert _all_gone({pid for pids in plugin.SEEN.values() for pid in pids}), "a mesh of the failed run outlived it"


def test_one_session_hosts_one_run_after_another_with_fresh_actors_in_the_same_processes(tiny_session,
                                                                                         tiny_run_config):
    """Two runs of the same seeded config on one session: the second one's actors are new (same
    step metrics: fresh weights, optimizer and engine) in the first one's processes."""
    from meshrl.controller.runtime import Runtime

    runs = []
    for name in ("first", "second"):
        cfg = tiny_run_config(f"output.name={name}", "trainer.eval.every=0", "trainer.eval.at_start=false")
        with Runtime(cfg, session=tiny_session) as rt:
            metrics = [rt.loop.step()[0] for _ in range(2)]
            runs.append(({m: list(p) for m, p in rt.meshes.pids.items()}, metrics))
    (pids_a, first), (pids_b, second) = runs
    assert pids_a == pids_b and set(pids_a) == {"learner", "generator", "rewarder"}
    for a, b in zip(first, second):
        assert (a["loss/total"], a["reward/mean"], a["train/grad_norm"]) == (
            b["loss/total"], b["reward/mean"], b["train/grad_norm"])
    with pytest.raises(ValueError, match="meshes: this session's processes were made for another"):
        Runtime(tiny_run_config("meshes.generator.procs=2"), session=tiny_session)
