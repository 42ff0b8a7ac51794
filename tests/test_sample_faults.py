"""What a sampling request may cost the generator that serves it (`MeshClient.sample`), against fake
generators: an exception raised for one request fails that request alone (`RequestFailed`) and
replaces nothing; a generator whose engine breaks or whose process dies while a request runs is
replaced once, and that request fails with the cause (`RequestLost`) instead of being issued again
to break the replacement too; a generator found dead before a request is sent is replaced first and
the request is served."""

import pytest

from meshrl.config.faults import FaultsConfig
from meshrl.engines import PromptScoring, SampleRequest, Sampled
from meshrl.engines.vllm_loop import EngineFailed
from meshrl.meshes.client import MeshClient, RequestFailed, RequestLost
from meshrl.meshes.supervisor import ProcessDied, Supervisor
from meshrl.testing.fake_meshes import FakeMeshGroup, Mesh


class Engine:
    """A generator whose engine raises ValueError for a seed past int64 (as torch does) and breaks
    for good on a seed of -1 (as a vLLM step that raises does)."""

    def __init__(self):
        self.broken = False
        self.served = 0

    def sample(self, prompt, request, scoring, version=None):
        if self.broken:
            raise EngineFailed("the vLLM engine failed: earlier step raised")
        if request.seed is not None and request.seed >= 2**63:
            raise ValueError("Overflow when unpacking long long")
        if request.seed == -1:
            self.broken = True
            raise EngineFailed("the vLLM engine failed: RuntimeError: bad seed")
        self.served += 1
        return Sampled([], None)

    def update_weights(self, version):  # what a replacement is re-synced with
        return {"version": version}


class Group(FakeMeshGroup):
    def __init__(self):
        super().__init__(generator=Mesh([Engine()]))
        self.dead: str | None = None
        self.spawned = 1

    def respawn(self, name):
        self["generator"] = Mesh([Engine()])
        self.dead, self.spawned = None, self.spawned + 1
        return ["generator"]

    def dead_process(self, name):
        return self.dead


def _client():
    group = Group()
    sup = Supervisor(group, FaultsConfig(max_restarts=2))
    return MeshClient(group, sup, {"generator": 5.0, "sync": 5.0}, 1), group, sup


def _sample(client, seed):
    return client.sample([1, 2], SampleRequest(n=1, max_tokens=2, seed=seed), PromptScoring())


def test_an_exception_for_one_request_fails_it_alone_and_replaces_nothing():
    client, group, sup = _client()
    for _ in range(5):  # more than the restart budget: none of it is spent
        with pytest.raises(RequestFailed, match="ValueError: Overflow when unpacking long long"):
            _sample(client, 2**64)
    _sample(client, 7)
    assert sup.restart_counts == {} and group.spawned == 1
    assert group["generator"].actors[0].served == 1


def test_a_request_that_breaks_the_engine_is_not_issued_again():
    client, group, sup = _client()
    with pytest.raises(RequestLost, match="bad seed.*not issued again"):
        _sample(client, -1)
    assert sup.restart_counts == {"generator": 1} and group.spawned == 2  # replaced once, not twice
    _sample(client, 7)  # the replacement serves
    assert group["generator"].actors[0].served == 1


def test_a_generator_found_dead_before_a_request_is_replaced_and_the_request_served():
    client, group, sup = _client()
    group.dead = "process 12 of mesh 'generator' is gone"
    _sample(client, 7)
    assert sup.restart_counts == {"generator": 1} and group["generator"].actors[0].served == 1


def test_a_process_that_dies_under_a_request_fails_it_with_the_cause():
    client, group, sup = _client()

    def dies(prompt, request, scoring, version=None):
        raise ProcessDied("generator.sample: process 12 of mesh 'generator' died")

    group["generator"].actors[0].sample = dies
    with pytest.raises(RequestLost, match="died"):
        _sample(client, 7)
    assert group.spawned == 2
