"""A mesh replaced while the host it lost is not yet seen as lost (a killed host worker still
exiting): the replacement spawned on every host does not come up, and once the host is seen lost
the mesh comes up on the surviving hosts instead of failing the run. Fake host meshes stand in for
Monarch's (the real path runs in test_launch_process)."""

import pytest

from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import MeshesConfig
from meshrl.meshes.group import MeshGroup, MeshSpawnError
from meshrl.meshes.hosts import Hosts


class _Reply:
    def __init__(self, value):
        self.value, self.waited = value, False

    def get(self, timeout=None):
        self.waited = True
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _Actors:
    def __init__(self, hosts: int, failing: bool):
        self.hosts, self.failing = hosts, failing

    @property
    def info(self):
        return self

    def call(self):
        if self.failing:
            return _Reply(ValueError("error spawning proc mesh: statuses: Running=0..1;Timeout(30s)=1..2"))
        return _Reply({(h,): {"pid": 1, "host": "elsewhere"} for h in range(self.hosts)})


class _Procs:
    def __init__(self, hosts: int, failing: bool):
        self.hosts, self.failing, self.stopped = hosts, failing, None

    def spawn(self, name, cls, *args, **kwargs):
        return _Actors(self.hosts, self.failing)

    def stop(self):
        """The stop's reply (``stopped``): on a lost host, waiting for it would hang."""
        self.stopped = _Reply(None)
        return self.stopped


class _HostMesh:
    """``dead`` hosts cannot start processes; a spawn that includes one does not come up."""

    def __init__(self, hosts: range, dead: set[int], spawned: list):
        self.hosts, self.dead, self.spawned = hosts, dead, spawned

    def slice(self, hosts: slice):
        return _HostMesh(self.hosts[hosts], self.dead, self.spawned)

    def spawn_procs(self, per_host, name, bootstrap=None):
        procs = _Procs(len(self.hosts), failing=bool(self.dead & set(self.hosts)))
        self.spawned.append((name, list(self.hosts), procs))
        return procs


def _group(probe, on_spawn=None):
    """The group, every spawn it makes, and the set of sampler hosts that are down (none yet)."""
    spawned: list = []
    down: set[int] = set()
    cfg = LaunchConfig(launcher="process", hosts={"trainer": 1, "sampler": 2}, place={"generator": "sampler"})
    hosts = Hosts({"trainer": _HostMesh(range(1), set(), spawned), "sampler": _HostMesh(range(2), down, spawned)},
                  cfg, probe, on_spawn)
    return MeshGroup(MeshesConfig(spawn_timeout_s=5), hosts), spawned, down


class _Probe:
    """Reports host 1 of `sampler` lost from its ``seen_from``-th call on (1 = first)."""

    def __init__(self, seen_from: int):
        self.calls, self.seen_from = 0, seen_from

    def __call__(self):
        self.calls += 1
        return {"sampler": {1}} if self.calls >= self.seen_from else {}


def _spawn_generator(group, spawned, down):
    """The generator on both sampler hosts; then host 1 goes down. Its proc mesh."""
    group.spawn("generator", object)
    group.wait_ready(["generator"])
    down.add(1)
    return spawned[-1][2]


@pytest.mark.parametrize("on_spawn_fails", [False, True])
def test_a_replacement_that_waited_on_a_host_not_yet_seen_lost_comes_up_on_the_survivors(on_spawn_fails):
    def forward_logs(procs):  # the process launcher's log forwarding waits for the processes to start
        if procs.failing:
            raise ValueError("error spawning proc mesh: statuses: Running=0..1;Timeout(30s)=1..2")

    probe = _Probe(seen_from=2)  # the respawn's first look finds every host alive
    group, spawned, down = _group(probe, forward_logs if on_spawn_fails else None)
    first = _spawn_generator(group, spawned, down)
    assert group.respawn("generator") == ["generator"]
    assert [(name, hosts) for name, hosts, _ in spawned] == [
        ("generator-g0", [0, 1]), ("generator-g1", [0, 1]), ("generator-g2", [0])]
    assert group.hosts.events == [{"host_mesh": "sampler", "host": 1}]
    assert group.procs_of("generator") == 1 and group.proc_meshes["generator"] is spawned[-1][2]
    group.stop()
    assert spawned[1][2].stopped is None  # the mesh waiting on the lost host is abandoned
    # the first mesh's stop began while its host still looked alive; the host is lost since, so
    # shutdown does not wait for that stop (with Monarch it would wait out its timeout)
    assert first.stopped is not None and not first.stopped.waited


def test_a_replacement_that_fails_while_no_host_is_found_lost_still_fails_naming_the_mesh():
    group, spawned, down = _group(_Probe(seen_from=10**9))
    _spawn_generator(group, spawned, down)
    with pytest.raises(MeshSpawnError, match=r"^mesh 'generator' failed during setup: error spawning proc mesh"):
        group.respawn("generator")
    assert len(spawned) == 2  # no second try: no host was found lost


def test_a_host_already_seen_lost_is_left_out_of_the_first_replacement():
    group, spawned, down = _group(_Probe(seen_from=1))
    _spawn_generator(group, spawned, down)
    group.respawn("generator")
    assert [hosts for _, hosts, _ in spawned] == [[0, 1], [0]]
