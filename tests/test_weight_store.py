"""Weight store with real Monarch processes: a publisher actor and two readers (one sync, one async
actor) on separate proc meshes, the index singleton in this (controller) process."""

import os

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import asyncio  # noqa: E402
import hashlib  # noqa: E402
import time  # noqa: E402

import monarch.actor  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from monarch.actor import Actor, ActorError, endpoint, this_host  # noqa: E402

from meshrl.config.channels import WeightSyncConfig  # noqa: E402
from meshrl.channels.weight_store import (  # noqa: E402
    WeightPublisher,
    WeightPuller,
    WeightSyncError,
    silence_tcp_fallback_warning,
    weight_index,
)

pytestmark = pytest.mark.monarch

CFG = WeightSyncConfig(num_chunks=4, transfer_timeout_s=3, rpc_timeout_s=10, max_arenas=2)


def make_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """~4.7 MB of random weights, different per seed, with a tied pair and mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1000, 256, generator=g).to(torch.bfloat16)
    sd = {"embed.weight": emb, "head.weight": emb, "norm.weight": torch.randn(256, generator=g)}
    for i in range(4):
        sd[f"layers.{i}.proj.weight"] = torch.randn(512, 512, generator=g)
    return sd


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in tensors.items()
    }


class Publisher(Actor):
    def __init__(self, store: str, cfg: WeightSyncConfig):
        self.publisher = WeightPublisher(store, cfg)

    @endpoint
    def publish(self, version: int, seed: int | None = None):
        sd = make_state_dict(version if seed is None else seed)
        return self.publisher.publish(sd, version), checksums(sd)

    @endpoint
    def reclaim(self) -> list[int]:
        return self.publisher.reclaim()

    @endpoint
    def versions(self) -> list[int]:
        return self.publisher.versions

    @endpoint
    def crash(self) -> None:
        os._exit(1)


def _pull_summary(result):
    return {"version": result.version, "checksums": checksums(result.tensors), "nbytes": result.stats.nbytes}


def _read_first_chunk(handle) -> str:
    chunk = handle.chunks[0]
    dst = torch.empty(chunk.nbytes, dtype=torch.uint8)
    try:
        chunk.buffer.read_into(dst, timeout=3).get(timeout=10)
    except Exception as e:
        return f"failed: {e}"
    return "ok"


class SyncReader(Actor):
    """Uses the sync API (sync actor endpoints)."""

    def __init__(self, cfg: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.cfg = cfg
        self.pullers: dict[str, WeightPuller] = {}

    @endpoint
    def pull(self, store: str, min_version: int = 0, timeout_s: float | None = None):
        puller = self.pullers.setdefault(store, WeightPuller(store, self.cfg))
        return _pull_summary(puller.pull(min_version, timeout_s))

    @endpoint
    def read_first_chunk(self, handle) -> str:
        return _read_first_chunk(handle)


class AsyncReader(Actor):
    """Uses the coroutine API (async actor endpoints)."""

    def __init__(self, cfg: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.cfg = cfg
        self.pullers: dict[str, WeightPuller] = {}

    @endpoint
    async def pull(self, store: str, min_version: int = 0, timeout_s: float | None = None):
        puller = self.pullers.setdefault(store, WeightPuller(store, self.cfg))
        return _pull_summary(await puller.apull(min_version, timeout_s))


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    # actor procs unpickle the actor classes above by module name: let them import this file
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    faults = []
    default_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append  # the crash test kills a process on purpose
    silence_tcp_fallback_warning()
    meshes = {name: this_host().spawn_procs(per_host={"procs": 1}) for name in ("pub", "r1", "r2")}
    ns = type("Cluster", (), {})()
    ns.meshes = meshes
    ns.pub = meshes["pub"].spawn("publisher", Publisher, "policy", CFG)
    ns.readers = [meshes["r1"].spawn("reader", SyncReader, CFG), meshes["r2"].spawn("reader", AsyncReader, CFG)]
    ns.index = weight_index().get(timeout=30)
    ns.faults = faults
    yield ns
    for pm in meshes.values():
        try:
            pm.stop().get(timeout=30)
        except Exception:
            pass
    monarch.actor.unhandled_fault_hook = default_hook


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def pull_all(cluster, store="policy", min_version=0, timeout_s=None):
    futures = [r.pull.call_one(store, min_version, timeout_s) for r in cluster.readers]
    return [f.get(timeout=60) for f in futures]


def describe(cluster, store="policy"):
    return cluster.index.describe.call_one(store).get(timeout=10)


def test_readers_get_bitwise_copies_and_versions_advance(cluster):
    for version in (1, 2):
        stats, published = cluster.pub.publish.call_one(version).get(timeout=60)
        assert stats.version == version and stats.nbytes > 4_000_000
        for got in pull_all(cluster):
            assert got["version"] == version
            assert got["checksums"] == published
            assert got["nbytes"] == stats.nbytes
    assert describe(cluster)["latest"] == 2
    assert cluster.index.latest.call_one("policy").get(timeout=10) == 2
    assert cluster.index.latest.call_one("no-such-store").get(timeout=10) is None


def test_reader_with_latest_version_gets_no_transfer(cluster):
    latest = describe(cluster)["latest"]
    for got in pull_all(cluster):
        assert got["version"] == latest and got["nbytes"] == 0


def test_leased_version_stays_readable_and_is_dropped_after_release(cluster):
    version = describe(cluster)["latest"]
    handle, lease = cluster.index.acquire.call_one("policy", version, None, 1.0, 60.0).get(timeout=10)
    stats, _ = cluster.pub.publish.call_one(version + 1).get(timeout=60)
    assert version not in stats.reclaimed
    state = describe(cluster)
    assert state["versions"] == [version, version + 1] and state["leases"] == {version: 1}
    assert cluster.readers[0].read_first_chunk.call_one(handle).get(timeout=30) == "ok"

    assert cluster.index.release.call_one("policy", version, lease).get(timeout=10) is True
    assert cluster.pub.reclaim.call_one().get(timeout=30) == [version]
    assert describe(cluster)["versions"] == [version + 1]
    assert cluster.pub.versions.call_one().get(timeout=10) == [version + 1]
    outcome = cluster.readers[0].read_first_chunk.call_one(handle).get(timeout=30)
    assert outcome.startswith("failed") and "not found" in outcome


def test_unread_old_version_is_dropped_at_the_next_publish_and_its_arena_reused(cluster):
    before = describe(cluster)["latest"]
    stats, published = cluster.pub.publish.call_one(before + 1).get(timeout=60)
    assert stats.reclaimed == (before,) and stats.arenas == 2
    assert describe(cluster)["versions"] == [before + 1]
    assert all(got["checksums"] == published for got in pull_all(cluster))


def test_publish_waits_for_a_free_arena_then_times_out(cluster):
    latest = describe(cluster)["latest"]
    _, lease = cluster.index.acquire.call_one("policy", latest, None, 1.0, 60.0).get(timeout=10)
    cluster.pub.publish.call_one(latest + 1).get(timeout=60)  # second arena; `latest` stays leased
    start = time.monotonic()
    with pytest.raises(ActorError) as info:  # both arenas busy: v(latest) leased, v(latest+1) newest
        cluster.pub.publish.call_one(latest + 2).get(timeout=60)
    assert time.monotonic() - start < CFG.transfer_timeout_s + 3
    assert isinstance(info.value.exception, WeightSyncError)
    assert "all 2 arenas still hold versions" in str(info.value.exception)
    cluster.index.release.call_one("policy", latest, lease).get(timeout=10)
    stats, _ = cluster.pub.publish.call_one(latest + 2).get(timeout=60)
    assert stats.reclaimed == (latest, latest + 1)


def test_pull_waits_for_a_future_version_or_times_out_clearly(cluster):
    latest = describe(cluster)["latest"]
    waiting = cluster.readers[1].pull.call_one("policy", latest + 1, 20.0)
    time.sleep(0.3)
    _, published = cluster.pub.publish.call_one(latest + 1).get(timeout=60)
    got = waiting.get(timeout=60)
    assert got["version"] == latest + 1 and got["checksums"] == published

    start = time.monotonic()
    for reader in cluster.readers:
        with pytest.raises(ActorError) as info:
            reader.pull.call_one("policy", latest + 10, 1.0).get(timeout=30)
        assert isinstance(info.value.exception, WeightSyncError)
        msg = str(info.value.exception)
        assert msg == f"weight pull of 'policy': no version >= v{latest + 10} within 1s (index has v{latest + 1})"
    assert time.monotonic() - start < 6


def test_pull_from_a_dead_owner_raises_within_the_timeout(cluster):
    crash_pm = this_host().spawn_procs(per_host={"procs": 1})
    crashy = crash_pm.spawn("publisher", Publisher, "crashy", CFG)
    crashy.publish.call_one(1).get(timeout=60)
    crashy.crash.broadcast()
    time.sleep(0.5)
    start = time.monotonic()
    pulls = [reader.pull.call_one("crashy") for reader in cluster.readers]
    for pull in pulls:
        with pytest.raises(ActorError) as info:
            pull.get(timeout=30)
        assert isinstance(info.value.exception, WeightSyncError)
        msg = str(info.value.exception)
        assert msg.startswith("weight pull of 'crashy' v1 chunk ") and "\n" not in msg, msg
        assert "timed out" in msg or "failed" in msg
    assert time.monotonic() - start < CFG.transfer_timeout_s + 3
    try:
        crash_pm.stop().get(timeout=10)
    except Exception:
        pass

    # a restarted owner with the same id replaces the dead one's versions
    restart_pm = this_host().spawn_procs(per_host={"procs": 1})
    try:
        restarted = restart_pm.spawn("publisher", Publisher, "crashy", CFG)
        _, published = restarted.publish.call_one(1).get(timeout=60)
        assert all(got["checksums"] == published for got in pull_all(cluster, "crashy"))
    finally:
        restart_pm.stop().get(timeout=30)


def test_a_restarted_owner_may_reuse_version_numbers(cluster):
    first = cluster.meshes["pub"].spawn("first_owner", Publisher, "reused", CFG)
    _, published = first.publish.call_one(1).get(timeout=60)
    assert all(got["checksums"] == published for got in pull_all(cluster, "reused"))
    # same owner id (the store name) in a new publisher: the old versions are forgotten on first use
    second = cluster.meshes["pub"].spawn("second_owner", Publisher, "reused", CFG)
    _, republished = second.publish.call_one(1, 99).get(timeout=60)
    assert republished != published
    for got in pull_all(cluster, "reused"):
        assert got["version"] == 1 and got["nbytes"] > 0 and got["checksums"] == republished


def test_sync_api_refuses_to_block_an_event_loop():
    async def inside_a_loop():
        WeightPuller("policy").pull()

    with pytest.raises(RuntimeError, match="use the 'a'-prefixed coroutine"):
        asyncio.run(inside_a_loop())
