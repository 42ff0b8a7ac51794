"""Tenants that survive their learner process (fast). The learner's side with the tiny model in
process: a snapshot is the state of its step however training goes on while it is written, and a
fresh learner restored from it continues exactly like the original (adapter, AdamW state, step
count); the writer keeps only the newest complete snapshot. The API's side over a fake learner
process: whichever learner call the process dies in (during a call, between calls, while a
replacement is restoring, with snapshots written or still waiting), every training client ends
exactly where an uninterrupted run ends, with the same replies; a call the learner dies in twice
fails and changes nothing; the published weight versions come back, also when their checkpoint was
deleted. `tests/test_serve_crash.py` kills a real learner under `meshrl serve`."""

import json
import os
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from meshrl.api.journal import LearnerJournal
from meshrl.api.tenant_learner import LearnerFailed, TenantLearner
from meshrl.config.faults import FaultsConfig
from meshrl.meshes.client import MeshClient
from meshrl.meshes.supervisor import ProcessDied, Supervisor
from meshrl.testing.fake_meshes import FakeMeshGroup, Mesh
from meshrl.training.snapshots import latest_snapshot
from tests.test_tenants import (ALICE, _adam_state, _adapter, _assert_close, _datums, _step, _trainer,  # noqa: F401
                                model_path)


# ---- the learner's side: snapshots of a real adapter ------------------------------------------

def test_a_snapshot_is_its_steps_state_and_a_new_learner_continues_from_it(model_path, tmp_path):  # noqa: F811
    trainer = _trainer(model_path)
    trainer.tenants.add("alice", **ALICE)
    trainer.tenants.use("alice")
    _step(trainer, 0, 100)
    at_step = _adapter(trainer, "alice"), {k: v.clone() for k, v in _adam_state(trainer, "alice").items()}
    assert trainer.tenants.snapshot("alice", tmp_path, 7, wait=False)["durable"] in (None, 7)
    _step(trainer, 1, 100)  # training goes on while the snapshot is written: it must not leak in
    expected = _adapter(trainer, "alice")
    assert trainer.tenants.snapshots.wait("alice", 60) == 7
    assert latest_snapshot(tmp_path, "alice") == (7, tmp_path / "alice" / "7")

    replacement = _trainer(model_path)  # a fresh learner process: no adapter but `default`
    restored = replacement.tenants.restore("alice", tmp_path)
    assert restored == {"name": "alice", "rank": 4, "steps_applied": 1, "optimizer": True, "optimizer_type": "adamw",
                        "mark": 7}
    replacement.tenants.use("alice")
    _assert_close(_adapter(replacement, "alice"), at_step[0], atol=0)
    _assert_close(_adam_state(replacement, "alice"), at_step[1], atol=0)
    _step(replacement, 1, 100)  # the same second step: Adam's moments and step count came back
    _assert_close(_adapter(replacement, "alice"), expected, atol=1e-7)

    trainer.forward_backward(_datums(3), "importance_sampling")
    with pytest.raises(ValueError, match="holds accumulated gradients"):
        trainer.tenants.snapshot("alice", tmp_path, 8, wait=True)


def test_the_writer_keeps_the_newest_complete_snapshot_and_forgets_removed_adapters(model_path, tmp_path):  # noqa: F811
    trainer = _trainer(model_path)
    trainer.tenants.add("alice", **ALICE)
    trainer.tenants.use("alice")
    for mark in (1, 2, 3):  # submitted back to back: a waiting one is replaced by a newer one
        _step(trainer, mark, 100)
        trainer.tenants.snapshot("alice", tmp_path, mark, wait=False)
    last = _adapter(trainer, "alice")
    assert trainer.tenants.snapshots.wait("alice", 60) == 3
    assert sorted(d.name for d in (tmp_path / "alice").iterdir()) == ["3"]  # the older ones deleted
    (tmp_path / "alice" / ".tmp-4-dead").mkdir()  # what a writer killed mid-write leaves
    replacement = _trainer(model_path)
    assert replacement.tenants.restore("alice", tmp_path)["mark"] == 3
    assert sorted(d.name for d in (tmp_path / "alice").iterdir()) == ["3"]
    _assert_close(_adapter(replacement, "alice"), last, atol=0)

    trainer.tenants.use("default")
    trainer.tenants.remove("alice")
    trainer.tenants.snapshots.wait("alice", 60)
    assert not (tmp_path / "alice").exists()
    with pytest.raises(FileNotFoundError, match="no snapshot"):
        _trainer(model_path).tenants.restore("alice", tmp_path)


# ---- the API's side: a fake learner process ---------------------------------------------------

@dataclass
class State:
    """A tenant in miniature: weight, accumulated gradient, momentum, steps (order-sensitive)."""

    w: float
    g: float = 0.0
    m: float = 0.0
    steps: int = 0


class World:
    """What outlives a learner process: the snapshots on disk, and which calls kill it: by number
    (counted over all processes), the next ``die_in[endpoint]`` calls of an endpoint, and after
    the first death the next ``then[endpoint]`` ones."""

    def __init__(self, die_at=(), die_in=None, then=None, hold_writes=False):
        self.snapshots: dict[str, tuple[int, State]] = {}
        self.die_at, self.die_in, self.then = set(die_at), dict(die_in or {}), dict(then or {})
        self.hold_writes = hold_writes
        self.calls = 0
        self.learners: list[FakeLearnerProcess] = []

    def dies(self, endpoint: str) -> bool:
        if self.die_in.get(endpoint) or self.calls in self.die_at:
            self.die_in[endpoint] = self.die_in.get(endpoint, 1) - 1
            self.die_in.update(self.then)
            self.then = {}
            return True
        return False


ENDPOINTS = ("add_adapter", "use_adapter", "remove_adapter", "forward_backward", "forward", "optim_step",
             "save_adapter", "load_adapter", "snapshot_adapter", "restore_adapter", "publish")


class FakeLearnerProcess:
    """The Learner's tenant endpoints over `State`s. A snapshot is copied at the call and written
    at the start of the next call (the background writer), unless the world holds writes. The
    process dies (ProcessDied, after doing the work) where the world says."""

    def __init__(self, world: World):
        self.world = world
        self.adapters = {"default": State(0.0)}
        self.active = "default"
        self.waiting: dict[str, tuple[int, State]] = {}
        self.published: dict[int, float] = {}
        self.dead = False
        world.learners.append(self)
        for name in ENDPOINTS:
            setattr(self, name, self._endpoint(name, getattr(self, name)))

    def _endpoint(self, name, method):
        def call(*args):
            if self.dead:
                raise ProcessDied("process gone")
            self.world.calls += 1
            if not self.world.hold_writes:
                self._write_waiting()
            out = method(*args)
            if self.world.dies(name):
                self.dead = True
                raise ProcessDied(f"killed during call {self.world.calls}")
            return out
        return call

    def _write_waiting(self):
        self.world.snapshots.update(self.waiting)
        self.waiting.clear()

    def add_adapter(self, name, rank, alpha, seed, *flags):
        assert name not in self.adapters
        self.adapters[name] = State(float(seed))
        return {"name": name, "seed": seed}

    def use_adapter(self, name):
        self.active = name
        return {"name": name}

    def remove_adapter(self, name):
        assert name != self.active
        del self.adapters[name]

    def forward_backward(self, datums, *rest):
        s = self.adapters[self.active]
        s.g += sum(datums) * (1 + s.w)
        return {"loss": s.w * sum(datums)}

    def forward(self, datums, *rest):
        return [self.adapters[self.active].w]

    def optim_step(self, lr):
        s = self.adapters[self.active]
        s.m = 0.5 * s.m + s.g
        s.w -= lr * s.m
        s.steps, s.g = s.steps + 1, 0.0
        return {"steps": s.steps}

    def save_adapter(self, name, directory):  # new files, as the Learner's (a temporary written, renamed)
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "tmp").write_text(json.dumps(vars(replace(self.adapters[name]))))
        os.replace(Path(directory) / "tmp", Path(directory) / "state.json")

    def load_adapter(self, name, directory, with_optimizer):
        s = State(**json.loads((Path(directory) / "state.json").read_text()))
        self.adapters[name] = s if with_optimizer else State(s.w)

    def snapshot_adapter(self, name, root, mark, wait):
        assert self.adapters[name].g == 0.0
        self.waiting[name] = (mark, replace(self.adapters[name]))
        if wait:
            self._write_waiting()
        return {"durable": self.world.snapshots.get(name, (None,))[0]}

    def restore_adapter(self, name, root):
        mark, state = self.world.snapshots[name]
        self.adapters[name] = replace(state)
        return {"mark": mark}

    def publish(self, version):
        self.published[version] = self.adapters[self.active].w
        return {"version": version}


class RespawningGroup(FakeMeshGroup):
    def __init__(self, world):
        super().__init__(learner=Mesh([FakeLearnerProcess(world)]))
        self.world, self.pids = world, {"learner": [1]}
        self.gone: str | None = None

    def respawn(self, name):
        self["learner"] = Mesh([FakeLearnerProcess(self.world)])
        self.pids["learner"] = [self.pids["learner"][0] + 1]
        self.gone = None
        return ["learner"]

    def dead_process(self, name):
        return self.gone  # a reason once a test says the process is gone


def _tenant_learner(world, root, max_restarts=3):
    meshes = RespawningGroup(world)
    supervisor = Supervisor(meshes, FaultsConfig(max_restarts=max_restarts))
    client = MeshClient(meshes, supervisor, {"learner": 5.0, "generator": 5.0, "sync": 5.0}, 1)
    learner = TenantLearner(client, supervisor, LearnerJournal(root / ".recovery", keep_versions=3),
                            threading.Lock(), lambda: meshes.pids["learner"])
    client.on_learners("publish", 0, supervised=False)
    learner.journal.published(0, None)
    return learner


class Resending:
    """A client of a `TenantLearner` that sends a call again once when the learner died during it
    (the learner does not: the call may be what killed it)."""

    def __init__(self, tl):
        self.tl = tl

    def __getattr__(self, name):
        method = getattr(self.tl, name)

        def call(*args):
            try:
                return method(*args)
            except LearnerFailed:
                return method(*args)
        return call


def _script(tl, root):
    """Two tenants as training clients drive them (sending a call again once when the learner
    died during it); the replies they see."""
    tl = Resending(tl)
    seen = [tl.call(None, "add_adapter", ("a", 4, None, 1.0, True, True, False)),
            tl.call(None, "add_adapter", ("b", 8, None, 2.0, True, True, False))]
    for i in range(3):
        seen.append(tl.call("a", "forward_backward", ([1, i], "ce", {}, False, True)))
        seen.append(tl.call("b", "forward_backward", ([3], "ce", {}, False, True)))
        seen.append(tl.call("a", "forward_backward", ([2], "ce", {}, False, True)))
        seen.append(tl.call("a", "optim_step", (0.1,)))
        seen.append(tl.call("b", "optim_step", (0.2,)))
        if i == 1:
            tl.call("a", "save_adapter", ("a", str(root / "ckpt-a")))
            seen.append(tl.publish("a", root / "ckpt-a"))
            tl.call("b", "load_adapter", ("b", str(root / "ckpt-a"), True))  # b continues from a's state
            tl.call(None, "add_adapter", ("c", 4, None, 3.0, True, True, False))
            seen.append(tl.call("c", "forward_backward", ([1], "ce", {}, False, True)))
            seen.append(tl.call("c", "optim_step", (0.3,)))
            tl.forget("c")  # its client closed: gone, and not restored
    seen.append(tl.call("a", "forward_backward", ([5], "ce", {}, False, True)))  # pending at the end
    seen.append(tl.call("b", "forward", ([1],)))
    return seen


def _final(world):
    learner = world.learners[-1]
    return {n: s for n, s in learner.adapters.items()}, learner.published


def _reference(tmp_path):
    world = World()
    tl = _tenant_learner(world, tmp_path / "ref")
    return _script(tl, tmp_path / "ref"), _final(world), world.calls, tl


@pytest.mark.parametrize("hold_writes", [False, True], ids=["written", "held"])
def test_whichever_call_the_learner_dies_in_every_tenant_ends_as_without_the_crash(tmp_path, hold_writes):
    replies, (states, published), calls, ref = _reference(tmp_path)
    assert sorted(states) == ["a", "b", "default"] and sorted(published) == [0, 1]
    # the journal is bounded: the calls since the newest snapshot on disk (the last step's snapshot
    # is written during the next call, so at most two steps' calls)
    assert [c.endpoint for c in ref.journal.log_of("a")] == ["forward_backward", "forward_backward", "optim_step",
                                                               "forward_backward"]
    for die_at in range(2, calls + 1):  # call 1: the base model's publish at start
        root = tmp_path / f"{die_at}"
        world = World(die_at=[die_at], hold_writes=hold_writes)
        tl = _tenant_learner(world, root)
        assert _script(tl, root) == replies, die_at
        assert _final(world) == (states, published), die_at
        assert len(world.learners) == 2 and len(tl.replacements) == 1, die_at
    # a replacement that dies while it publishes the versions again or restores a tenant is replaced in turn
    for then in ({"publish": 1}, {"restore_adapter": 1}):
        root = tmp_path / f"twice-{sorted(then)[0]}"
        world = World(die_at=[calls - 12], then=then, hold_writes=hold_writes)
        tl = _tenant_learner(world, root)
        assert _script(tl, root) == replies and _final(world) == (states, published), then
        assert len(world.learners) == 3 and len(tl.replacements) == 1


def test_a_call_the_learner_dies_in_fails_changes_nothing_and_is_not_issued_again(tmp_path):
    world = World()
    tl = _tenant_learner(world, tmp_path)
    tl.call(None, "add_adapter", ("a", 4, None, 1.0, True, True, False))
    tl.call("a", "forward_backward", ([1], "ce", {}, False, True))
    tl.call("a", "optim_step", (0.1,))
    tl.call("a", "forward_backward", ([2], "ce", {}, False, True))
    before = replace(world.learners[-1].adapters["a"])
    world.die_in = {"optim_step": 2}  # it would kill the replacement too, were it issued again
    with pytest.raises(LearnerFailed, match=r"learner.optim_step: killed during call \d+: the learner died during "
                                            "this call, which is not issued again"):
        tl.call("a", "optim_step", (0.1,))
    assert len(world.learners) == 2  # one replacement, not two
    assert world.learners[-1].adapters["a"] == before  # the pending gradient is back, nothing applied
    world.die_in = {}
    assert tl.call("a", "optim_step", (0.1,)) == {"steps": 2}
    # a learner found dead before a call is replaced first, and the call runs on the replacement
    world.learners[-1].dead = True
    tl.client.meshes.gone = "process 2 of mesh 'learner' is gone"
    assert tl.call("a", "forward", ([1],)) == [world.learners[-1].adapters["a"].w]
    assert len(world.learners) == 3
    # past the restart budget (3 replacements within the window) the call fails, naming the mesh
    world.die_in = {"forward": 2}
    with pytest.raises(LearnerFailed):
        tl.call("a", "forward", ([1],))
    with pytest.raises(RuntimeError, match="mesh 'learner' failed 4 times"):
        tl.call("a", "forward", ([1],))


def test_published_versions_come_back_even_when_their_checkpoint_is_deleted(tmp_path):
    world = World()
    tl = _tenant_learner(world, tmp_path)
    tl.call(None, "add_adapter", ("a", 4, None, 1.0, True, True, False))
    versions = {}
    for i in range(4):  # keep_versions = 3: version 0 and 1 are gone by the end
        tl.call("a", "forward_backward", ([1], "ce", {}, False, True))
        tl.call("a", "optim_step", (0.1,))
        tl.call("a", "save_adapter", ("a", str(tmp_path / f"s{i}")))
        versions[tl.publish("a", tmp_path / f"s{i}")] = world.learners[-1].adapters["a"].w
    shutil.rmtree(tmp_path / "s2")  # a client deletes the checkpoint a sampler was made from
    tl.call("a", "forward_backward", ([1], "ce", {}, False, True))
    tl.call("a", "optim_step", (0.1,))
    tl.call("a", "save_adapter", ("a", str(tmp_path / "s3")))  # ... or saves it again under its name
    world.die_at = {world.calls + 1}
    with pytest.raises(LearnerFailed):
        tl.call("a", "forward", ([1],))
    assert world.learners[-1].published == {v: versions[v] for v in (2, 3, 4)}
    assert sorted(p.name for p in (tmp_path / ".recovery" / ".versions").iterdir()) == ["2", "3", "4"]
    assert sorted(world.learners[-1].adapters) == ["a", "default"]  # the scratch adapter is gone
