"""Dynamic dispatch over generator replicas against fake Monarch endpoints (each fake actor serves
its calls in order on a thread of its own): chunks spread over the replicas, a slow replica's chunk
is hedged and the call finishes without it, the slow replica stays out of the next call and of the
weight sync until it has finished, the seed of each prompt does not depend on who served it, and
failures surface."""

import time

import pytest

from meshrl.actors.generator import GenerationBatch
from meshrl.config.faults import FaultsConfig
from meshrl.config.meshes import GENERATOR
from meshrl.meshes.dispatch import Dispatcher, chunk_bounds
from meshrl.meshes.client import MeshClient, StepError
from meshrl.meshes.supervisor import CallTimeout, ProcessDied, Supervisor
from meshrl.engines import Completion, SampleRequest
from meshrl.testing.fake_meshes import FakeGenerator, FakeMeshGroup, Mesh

REQUEST = SampleRequest(n=2, max_tokens=4, seed=1000)


class SeedEcho(FakeGenerator):
    """Samples like vLLM: prompt j of a call is sampled with ``request.seed + j``, here echoed back
    as the sample's tokens (seed, sample index)."""

    def generate(self, prompts, request):
        self.seen.append(len(prompts))
        time.sleep(self.delay)
        meta = {"replica": self.replica, "version": self.version}
        groups = [[Completion([request.seed + j, k], [0.0, 0.0], "stop", "", dict(meta)) for k in range(request.n)]
                  for j in range(len(prompts))]
        return GenerationBatch(groups, self.version, self.delay, 0, self.replica)


def _client(delays, chunks_per_replica=4, timeout_s=5.0):
    gens = [SeedEcho(r) for r in range(len(delays))]
    for g, d in zip(gens, delays):
        g.delay = d
    meshes = FakeMeshGroup(generator=Mesh(gens))
    client = MeshClient(meshes, Supervisor(meshes, FaultsConfig()), {"generator": timeout_s, "sync": timeout_s},
                        chunks_per_replica)
    return client, gens


def _prompts(n):
    return [[i] for i in range(n)]


def test_chunks_are_cut_from_the_batch_size_and_replica_count_only():
    assert chunk_bounds(8, 2, 4) == [(i, i + 1) for i in range(8)]
    assert chunk_bounds(20, 2, 2) == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert chunk_bounds(8, 1, 4) == [(0, 8)]  # one replica: one call
    assert chunk_bounds(3, 2, 4) == [(0, 1), (1, 2), (2, 3)]


def test_chunks_spread_over_the_replicas():
    client, gens = _client([0.02, 0.02])
    groups = client.generate(_prompts(16), REQUEST)
    assert len(groups) == 16 and all(len(g) == 2 for g in groups)
    assert all(len(g.seen) >= 2 for g in gens)  # every replica got several chunks
    assert sum(sum(g.seen) for g in gens) >= 16


def test_a_slow_replica_is_hedged_and_kept_out_until_it_has_finished():
    client, (fast, slow) = _client([0.0, 2.0])
    started = time.monotonic()
    groups = client.generate(_prompts(8), REQUEST)
    assert time.monotonic() - started < 1.0  # the slow replica's chunk was served again by the fast one
    assert [g[0].tokens[0] for g in groups] == [1000 + i for i in range(8)]
    assert {g[0].meta["replica"] for g in groups} == {0}
    # the late duplicate keeps the slow replica busy: the next call and the weight sync go without it
    client.generate(_prompts(4), REQUEST)
    pulls = client.sync_readers(1)[GENERATOR]
    assert [p["version"] for p in pulls] == [1] and fast.version == 1 and slow.seen == [1]
    assert time.monotonic() - started < 1.5
    # once it has finished, it has pulled the version (queued behind its late chunk) and works again
    time.sleep(2.2 - (time.monotonic() - started))
    slow.delay = 0.0
    client.generate(_prompts(16), REQUEST)
    assert slow.version == 1 and len(slow.seen) > 1


@pytest.mark.parametrize("delays,chunks", [([0.0], 4), ([0.0, 0.3], 4), ([0.01, 0.0, 0.02], 2)])
def test_prompt_i_is_sampled_with_seed_plus_i_whoever_serves_it(delays, chunks):
    client, _ = _client(delays, chunks)
    groups = client.generate(_prompts(10), REQUEST)
    assert [[c.tokens for c in g] for g in groups] == [[[1000 + i, k] for k in range(2)] for i in range(10)]


def test_a_failed_chunk_surfaces():
    client, (_, broken) = _client([0.0, 0.0])

    def generate(prompts, request):
        raise ValueError("engine exploded")

    broken.generate = generate
    with pytest.raises(ValueError, match="engine exploded"):
        client.generate(_prompts(8), REQUEST)


def _issue(generator, start, stop):
    return generator.generate.call_one(_prompts(stop - start), REQUEST)


def test_the_call_deadline_and_the_watch_still_apply():
    gens = [SeedEcho(0), SeedEcho(1)]
    for g in gens:
        g.delay = 1.0
    with pytest.raises(CallTimeout, match=r"generator.generate timed out after 0.3s"):
        Dispatcher().run(Mesh(gens), 2, 4, 4, _issue, 0.3, "generator.generate")
    with pytest.raises(ProcessDied, match="generator.generate: process 7 is gone"):
        Dispatcher().run(Mesh(gens), 2, 4, 4, _issue, 5.0, "generator.generate", watch=lambda: "process 7 is gone")


def test_a_replica_still_busy_past_the_deadline_fails_the_next_call():
    gens = [SeedEcho(0), SeedEcho(1)]
    gens[1].delay = 1.0
    mesh, dispatcher = Mesh(gens), Dispatcher()
    dispatcher.run(mesh, 2, 4, 2, _issue, 0.5, "generator.generate")  # hedged: returns at once
    time.sleep(0.6)
    with pytest.raises(CallTimeout, match="generator.generate timed out after 0.5s"):
        dispatcher.run(mesh, 2, 4, 2, _issue, 0.5, "generator.generate")
    time.sleep(0.5)
    assert len(dispatcher.run(Mesh(gens), 2, 4, 2, _issue, 5.0, "generator.generate")) == 4  # a new mesh starts clean


def test_a_replica_that_dies_busy_with_a_late_duplicate_fails_the_next_call_at_once():
    """A replica killed while its hedged chunk runs leaves a call that never finishes: the next
    call, and the weight sync, see the dead process at once instead of waiting out the deadline."""
    gens = [SeedEcho(0), SeedEcho(1)]
    gens[1].delay = 2.0
    mesh, dispatcher = Mesh(gens), Dispatcher()
    dispatcher.run(mesh, 2, 4, 2, _issue, 30.0, "generator.generate")  # hedged: replica 1 stays busy
    alive = lambda: None  # noqa: E731
    dead = lambda: "process 7 of mesh 'generator' is gone"  # noqa: E731
    assert len(dispatcher.send_all(mesh, 2, lambda g: g.update_weights.call_one(1), lambda _: None, 30.0,
                                   "generator.update_weights", watch=alive)) == 1  # the free replica's pull
    started = time.monotonic()
    with pytest.raises(ProcessDied, match="generator.generate: process 7 of mesh 'generator' is gone"):
        dispatcher.send_all(mesh, 2, lambda g: g.update_weights.call_one(2), lambda _: None, 30.0,
                            "generator.update_weights", watch=dead)
    with pytest.raises(ProcessDied, match="generator.generate: process 7 of mesh 'generator' is gone"):
        dispatcher.run(mesh, 2, 4, 2, _issue, 30.0, "generator.generate", watch=dead)
    assert time.monotonic() - started < 1.0


def test_a_deferred_pull_that_loads_an_old_version_fails_a_later_call():
    client, (_, slow) = _client([0.0, 0.5])
    client.generate(_prompts(8), REQUEST)  # the slow replica is left with a late duplicate
    slow.update_weights = lambda v: {"version": v - 1, "pull_s": 0, "transfer_s": 0, "bytes": 0, "load_s": 0}
    client.sync_readers(1)
    time.sleep(0.6)
    with pytest.raises(StepError, match=r"generator.update_weights: a replica holds version 0 after a pull of 1"):
        client.generate(_prompts(8), REQUEST)
