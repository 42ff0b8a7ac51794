"""Supervisor: replace-and-retry within a restart budget (fake mesh group, real error types)."""

import pytest

from meshrl.config.faults import FaultsConfig
from meshrl.meshes.supervisor import CallTimeout, LearnerLost, RestartBudgetExceeded, Supervisor


class Group:
    def __init__(self, colocated=()):
        self.respawned = []
        self.colocated = set(colocated)

    def cohabitants(self, name):
        return sorted({name} | (self.colocated if name in self.colocated else set()))

    def respawn(self, name):
        self.respawned.append(name)
        return self.cohabitants(name)


def flaky(failures, value="ok"):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= failures:
            raise CallTimeout(f"generator.generate timed out (attempt {calls['n']})")
        return value

    return fn, calls


def test_failed_call_is_replaced_resynced_and_retried():
    group = Group()
    sup = Supervisor(group, FaultsConfig(max_restarts=3))
    resynced = []
    sup.on_respawn("generator", lambda: resynced.append(True))
    fn, calls = flaky(2)
    assert sup.run("generator", fn, "generator.generate") == "ok"
    assert calls["n"] == 3
    assert group.respawned == ["generator", "generator"]
    assert resynced == [True, True]
    assert sup.metrics()["faults/restarts/generator"] == 2
    assert [e["mesh"] for e in sup.events] == ["generator", "generator"]


def test_budget_exhaustion_names_mesh_and_cause():
    sup = Supervisor(Group(), FaultsConfig(max_restarts=1, restart_window_s=60))
    fn, _ = flaky(5)
    with pytest.raises(RestartBudgetExceeded, match=r"mesh 'rewarder' failed 2 times within 60s.*attempt 2"):
        sup.run("rewarder", fn, "rewarder.score")


def test_learner_and_its_cohabitants_escalate_to_resume():
    group = Group(colocated={"learner", "rewarder"})
    sup = Supervisor(group, FaultsConfig())
    fn, _ = flaky(1)
    with pytest.raises(LearnerLost) as info:
        sup.run("rewarder", fn, "rewarder.score")
    assert info.value.mesh == "rewarder" and "timed out" in info.value.cause
    assert group.respawned == []


def test_non_recoverable_errors_propagate_untouched():
    sup = Supervisor(Group(), FaultsConfig())

    def broken():
        raise KeyError("bug in controller code")

    with pytest.raises(KeyError):
        sup.run("generator", broken, "generator.generate")


def test_calls_that_fail_together_replace_the_mesh_once():
    """Eight concurrent calls on one generator mesh fail at once (its process died): one
    replacement, after which every call is issued again on the new mesh and succeeds."""
    import threading

    group = Group()
    sup = Supervisor(group, FaultsConfig(max_restarts=2))
    all_issued = threading.Barrier(8)

    def call():
        if not group.respawned:  # the first mesh: every call fails, once all eight are in flight
            all_issued.wait(timeout=10)
            raise CallTimeout("generator.sample: the process died")
        return "ok"

    results = []
    threads = [threading.Thread(target=lambda: results.append(sup.run("generator", call, "generator.sample")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == ["ok"] * 8 and group.respawned == ["generator"]
