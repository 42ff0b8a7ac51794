"""Weight store with real Monarch processes: a publisher actor and two readers (one sync, one async
actor) on separate proc meshes, the index singleton in this (controller) process. Everything runs on
one host, so readers under transport auto copy from the publisher's shared memory; the sync reader
also pulls each store with transport rdma."""

import os

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import asyncio  # noqa: E402
import hashlib  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import monarch.actor  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from monarch.actor import Actor, ActorError, endpoint, this_host  # noqa: E402

from meshrl.testing.shards import split_rows  # noqa: E402

from meshrl.actors.follower import PolicyFollower  # noqa: E402
from meshrl.engines.vllm_sharding import rank_payload  # noqa: E402
from meshrl.transport.arena import views  # noqa: E402
from meshrl.transport.shards import TensorSlice, moves, whole_bucket  # noqa: E402
from meshrl.transport.same_host import (  # noqa: E402
    CudaIpcRef,
    HostFiller,
    PREFIX,
    SHM_DIR,
    SameHostReader,
    SameHostUnavailable,
    host_identity,
    local_transport,
    remove_stale_segments,
)
from meshrl.config.weight_sync import WeightSyncConfig  # noqa: E402
from meshrl.transport.weight_store import (  # noqa: E402
    WeightPublisher,
    WeightPuller,
    WeightSyncError,
    silence_tcp_fallback_warning,
    weight_index,
)

pytestmark = pytest.mark.monarch

CFG = WeightSyncConfig(num_chunks=4, transfer_timeout_s=3, rpc_timeout_s=10, max_arenas=2)
PULLS = [(0, {}), (1, {}), (0, {"transport": "rdma"})]  # (reader, config overrides) of pull_all
EXPECTED_TRANSPORTS = ["shm", "shm", "rdma"]


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
        name: hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in tensors.items()
    }


def segments_of(pid: int) -> set[str]:
    """Shared-memory segments created by process ``pid`` (their names carry it)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX + ".") and n.split(".")[2] == str(pid)}


def local_checksums(handle) -> dict[str, str]:
    """Checksums of a published version read by this (controller) process from shared memory."""
    (part,) = handle.parts
    dst = torch.empty(handle.layout.total_bytes, dtype=torch.uint8)
    SameHostReader().copy_moves(part.local, dst, moves(whole_bucket(handle.layout), [part.pieces]))
    return checksums(views(dst, handle.layout))


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
    def close(self) -> None:
        self.publisher.close()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def crash(self) -> None:
        os._exit(1)


class ShardPublisher(Actor):
    """Rank ``rank`` of ``world`` publishers of one store: each publishes its FSDP2-style rows."""

    def __init__(self, store: str, cfg: WeightSyncConfig, rank: int, world: int, group: str = "learner"):
        self.publisher = WeightPublisher(store, cfg, rank=rank, world=world, group=group)

    @endpoint
    def publish(self, version: int, seed: int | None = None):
        sd = make_state_dict(version if seed is None else seed)
        shards = split_rows(sd, self.publisher.rank, self.publisher.world)
        return self.publisher.publish_shards(shards, version), checksums(sd)

    @endpoint
    def versions(self) -> list[int]:
        return self.publisher.reclaim() and self.publisher.versions

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class SlowReader(Actor):
    """Pulls bucket by bucket into a loader that takes a second per bucket."""

    def __init__(self, cfg: WeightSyncConfig):
        self.puller = WeightPuller("torn", cfg.model_copy(update={"pull_bucket_mib": 1}))

    @endpoint
    def pull_slowly(self, store: str, version: int) -> None:
        self.puller.pull_into(lambda items: time.sleep(1.0), version)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _pull_summary(result):
    return {
        "version": result.version,
        "checksums": checksums(result.tensors),
        "nbytes": result.stats.nbytes,
        "transport": result.stats.transport,
    }


def _puller(pullers: dict, cfg: WeightSyncConfig, store: str, overrides: dict | None) -> WeightPuller:
    key = (store, tuple(sorted((overrides or {}).items())))
    if key not in pullers:
        pullers[key] = WeightPuller(store, cfg.model_copy(update=overrides or {}))
    return pullers[key]


def _read_first_chunk(handle) -> str:
    chunk = handle.parts[0].chunks[0]
    dst = torch.empty(chunk.nbytes, dtype=torch.uint8)
    try:
        chunk.buffer.read_into(dst, timeout=3).get(timeout=10)
    except Exception as e:
        return f"failed: {e}"
    return "ok"


class RecordingEngine:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, items) -> None:
        self.loaded = {name: t.clone() for name, t in items}


class TensorParallelEngine:
    """Stands in for a vLLM engine of two tensor-parallel workers (the weight path is what is
    tested; vLLM's own loaders of slices are tested in test_vllm_sharding): worker ``r`` loads
    half ``r`` of each projection, of layers 0 and 2 by rows and of layers 1 and 3 by columns, and
    every other weight whole. It records what each worker was handed, as its worker would build it;
    a bucket handed off as a ``HostFill`` it fills as its worker would, with its own ``HostFiller``
    (``meshrl.engines.vllm_sharding.worker_fill_rank``)."""

    tensor_parallel_size = 2

    def __init__(self, device: str = "cpu"):
        self.device = device  # where each worker's bucket buffer lives (its model's device)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.loaded: list[dict[str, torch.Tensor]] = [{}, {}]
        self.sliced: list[set[str]] = [set(), set()]
        self.fillers = [HostFiller(), HostFiller()]
        self.plan_bytes = 0  # pickled size of the plans handed off (what would cross vLLM's RPC queue)

    def rank_slices(self, rank: int, shapes) -> dict[str, TensorSlice]:
        self.shapes = dict(shapes)
        return {name: TensorSlice(int(name.split(".")[1]) % 2, rank * shape[0] // 2, shape[0] // 2)
                for name, shape in self.shapes.items() if name.startswith("layers.")}

    def load_rank_weights(self, rank: int, items) -> None:
        payload = rank_payload(items, self.rank_slices(rank, self.shapes), self.shapes)
        self.loaded[rank].update((name, t.clone()) for name, t in payload.items)
        self.sliced[rank].update(payload.slices)

    def fill_rank(self, rank: int, plan, timeout_s: float) -> None:
        self.plan_bytes += len(pickle.dumps(plan))
        self.load_rank_weights(rank, self.fillers[rank].fill(plan, self.device).items())


class SyncReader(Actor):
    """Uses the sync API (sync actor endpoints)."""

    def __init__(self, cfg: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.cfg = cfg
        self.pullers: dict[tuple, WeightPuller] = {}

    @endpoint
    def pull(self, store: str, min_version: int = 0, timeout_s: float | None = None, overrides: dict | None = None,
             exact: bool = False):
        return _pull_summary(_puller(self.pullers, self.cfg, store, overrides).pull(min_version, timeout_s, exact))

    @endpoint
    def pull_buckets(self, store: str, min_version: int = 0, overrides: dict | None = None, slices=None):
        """A bucketed pull (of ``slices`` of the tensors) into a loader that records each bucket."""
        loaded, buckets = {}, []

        def load(items):
            buckets.append(sorted(name for name, _ in items))
            loaded.update((name, t.clone()) for name, t in items)

        if slices is None:
            result = _puller(self.pullers, self.cfg, store, overrides).pull_into(load, min_version)
        else:  # a reader of slices (another tensor-parallel rank) holds nothing yet
            result = WeightPuller(store, self.cfg.model_copy(update=overrides)).pull_into(
                load, min_version, slices=lambda shapes: slices)
        return {**_pull_summary(result), "checksums": checksums(loaded), "buckets": buckets,
                "read_bytes": result.stats.read_bytes}

    @endpoint
    def read_first_chunk(self, handle) -> str:
        return _read_first_chunk(handle)

    @endpoint
    def follow(self, store: str, min_version: int, exact: bool = False) -> tuple[dict, dict[str, str]]:
        """A PolicyFollower's update into an engine that records what it loads."""
        engine = RecordingEngine()
        stats = PolicyFollower(store, self.cfg, Path(".")).update(engine, min_version, exact)
        return stats, checksums(engine.loaded)

    @endpoint
    def follow_tensor_parallel(self, store: str, min_version: int, transport: str = "auto", device: str = "cpu"
                               ) -> list[tuple[dict, list[dict], list[list[str]], int]]:
        """Two PolicyFollower updates (bucketed) into a two-worker tensor-parallel engine whose
        workers hold their weights on ``device``: the stats, per worker the checksums it was handed
        and the names it got as slices, and the pickled bytes of the buckets handed off to them."""
        engine = TensorParallelEngine(device)
        cfg = self.cfg.model_copy(update={"pull_bucket_mib": 1, "transport": transport, "arena_device": device})
        follower = PolicyFollower(store, cfg, Path("."))
        out = []
        for _ in range(2):
            stats = follower.update(engine, min_version)
            out.append((stats, [checksums(loaded) for loaded in engine.loaded], [sorted(s) for s in engine.sliced],
                        engine.plan_bytes))
            engine.loaded, engine.sliced, engine.plan_bytes = [{}, {}], [set(), set()], 0
        return out

    @endpoint
    def mapped_segments(self) -> set[str]:
        """Shared-memory segments this process has mapped (deleted files included)."""
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1] for line in f if f"{SHM_DIR}/{PREFIX}." in line]
        return {p.strip().removesuffix(" (deleted)").rsplit("/", 1)[1] for p in paths}


class AsyncReader(Actor):
    """Uses the coroutine API (async actor endpoints)."""

    def __init__(self, cfg: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.cfg = cfg
        self.pullers: dict[tuple, WeightPuller] = {}

    @endpoint
    async def pull(
        self, store: str, min_version: int = 0, timeout_s: float | None = None, overrides: dict | None = None,
        exact: bool = False,
    ):
        puller = _puller(self.pullers, self.cfg, store, overrides)
        return _pull_summary(await puller.apull(min_version, timeout_s, exact))

    @endpoint
    async def pull_buckets(self, store: str, min_version: int = 0, overrides: dict | None = None):
        loaded = {}
        puller = _puller(self.pullers, self.cfg, store, overrides)
        result = await puller.apull_into(lambda items: loaded.update((n, t.clone()) for n, t in items), min_version)
        return {**_pull_summary(result), "checksums": checksums(loaded)}


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
    remove_stale_segments()  # stopped publishers could not unlink theirs
    monarch.actor.unhandled_fault_hook = default_hook


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def pull_all(cluster, store="policy", min_version=0, timeout_s=None, exact=False):
    """Pull ``store`` with every reader under transport auto and with the sync reader under rdma."""
    futures = [cluster.readers[r].pull.call_one(store, min_version, timeout_s, o, exact) for r, o in PULLS]
    return [f.get(timeout=60) for f in futures]


def describe(cluster, store="policy"):
    return cluster.index.describe.call_one(store).get(timeout=10)


def test_readers_get_bitwise_copies_and_versions_advance(cluster):
    for version in (1, 2):
        stats, published = cluster.pub.publish.call_one(version).get(timeout=60)
        assert stats.version == version and stats.nbytes > 4_000_000
        got_all = pull_all(cluster)
        assert [got["transport"] for got in got_all] == EXPECTED_TRANSPORTS
        for got in got_all:
            assert got["version"] == version
            assert got["checksums"] == published
            assert got["nbytes"] == stats.nbytes
    assert describe(cluster)["latest"] == 2
    assert cluster.index.latest.call_one("policy").get(timeout=10) == 2
    assert cluster.index.latest.call_one("no-such-store").get(timeout=10) is None


def test_reader_with_latest_version_gets_no_transfer(cluster):
    latest = describe(cluster)["latest"]
    for got in pull_all(cluster):
        assert got["version"] == latest and got["nbytes"] == 0 and got["transport"] == "none"


def test_shared_memory_pulls_stay_bitwise_across_versions_and_reuse_the_arenas(cluster):
    pid = cluster.pub.pid.call_one().get(timeout=10)
    segments = []
    for _ in range(3):
        version = describe(cluster)["latest"] + 1
        _, published = cluster.pub.publish.call_one(version).get(timeout=60)
        got_all = pull_all(cluster)
        assert [got["transport"] for got in got_all] == EXPECTED_TRANSPORTS
        assert all(got["version"] == version and got["checksums"] == published for got in got_all)
        segments.append(segments_of(pid))
    assert len(segments[0]) == 2 and segments[0] == segments[1] == segments[2]  # the pool of 2, reused
    assert cluster.readers[0].mapped_segments.call_one().get(timeout=10) <= segments[-1]


def test_the_policy_followers_stats_name_the_transport(cluster):
    version = describe(cluster)["latest"]
    stats, loaded = cluster.readers[0].follow.call_one("policy", version).get(timeout=60)
    assert stats["transport"] == "shm" and stats["version"] == version and stats["bytes"] > 0
    assert loaded == checksums(make_state_dict(version))


@pytest.mark.parametrize("transport,device", [
    ("auto", "cpu"), ("rdma", "cpu"),
    pytest.param("auto", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")),
])
def test_each_tensor_parallel_worker_is_handed_only_its_slices(cluster, transport, device):
    """A follower of a tensor-parallel engine pulls, per worker, the slices that worker loads and
    hands them to it alone: every worker gets its halves of the projections and the rest whole,
    the bytes moved are one rank's share per worker (not the whole model per worker), and a
    second update of the same version moves nothing. On the publisher's host (transport auto)
    each worker copies its buckets out of the publisher's shared memory itself: what is handed to
    it is a plan of a few KB, not the bytes (CUDA arenas: CUDA IPC handles, the workers' buffers on
    the GPU); over RDMA the follower pulls the buckets."""
    store = f"tp_{device}"
    owner = cluster.meshes["pub"].spawn(f"tp_owner_{device}", Publisher, store,
                                        CFG.model_copy(update={"arena_device": device}))
    owner.publish.call_one(3).get(timeout=60)
    whole = make_state_dict(3)
    (stats, loaded, sliced, plan_bytes), (again, loaded_again, _, _) = (
        cluster.readers[0].follow_tensor_parallel.call_one(store, 3, transport, device).get(timeout=60))
    for rank in (0, 1):
        expected = {name: t.narrow(int(name.split(".")[1]) % 2, rank * 256, 256) if name.startswith("layers.") else t
                    for name, t in whole.items()}
        assert loaded[rank] == checksums(expected)
        assert sliced[rank] == [f"layers.{i}.proj.weight" for i in range(4)]
    one_whole = 1000 * 256 * 2 + 256 * 4 + 4 * 512 * 512 * 4  # the tied head shares the embedding's bytes
    one_rank = 1000 * 256 * 2 + 256 * 4 + 4 * 512 * 256 * 4
    assert stats["version"] == 3 and stats["bytes"] == 2 * one_rank < 1.2 * one_whole
    if transport == "auto":
        local = "cuda_ipc" if device == "cuda" else "shm"
        assert stats["transport"] == f"worker_{local}" and 0 < plan_bytes < 20_000
    else:
        assert stats["transport"] == "rdma" and plan_bytes == 0
    assert again["version"] == 3 and again["bytes"] == 0 and loaded_again == [{}, {}]
    owner.close.call_one().get(timeout=30)


def test_exact_pulls_get_each_kept_versions_bytes_in_any_order(cluster):
    keep3 = CFG.model_copy(update={"keep_versions": 3, "max_arenas": 4})
    owner = cluster.meshes["pub"].spawn("exact_owner", Publisher, "exact", keep3)
    published = {v: owner.publish.call_one(v).get(timeout=60)[1] for v in (1, 2, 3)}
    assert describe(cluster, "exact")["versions"] == [1, 2, 3]
    for version in (2, 3, 1):
        got_all = pull_all(cluster, "exact", version, exact=True)
        assert [got["transport"] for got in got_all] == EXPECTED_TRANSPORTS
        assert all(got["version"] == version and got["checksums"] == published[version] for got in got_all)
    assert [got["nbytes"] for got in pull_all(cluster, "exact", 1, exact=True)] == [0, 0, 0]  # held: none moves
    stats, loaded = cluster.readers[0].follow.call_one("exact", 2, True).get(timeout=60)
    assert stats["version"] == 2 and loaded == published[2]

    stats, published[4] = owner.publish.call_one(4).get(timeout=60)
    assert stats.reclaimed == (1,) and describe(cluster, "exact")["versions"] == [2, 3, 4]
    for reader in cluster.readers:
        with pytest.raises(ActorError) as info:
            reader.pull.call_one("exact", 1, None, None, True).get(timeout=30)
        assert str(info.value.exception) == ("weight pull of 'exact' v1: not in the index (reclaimed, or never "
                                             "published; it holds v2, v3, v4)")
        with pytest.raises(ActorError) as info:
            reader.pull.call_one("exact", 9, 0.5, None, True).get(timeout=30)
        assert str(info.value.exception) == "weight pull of 'exact': v9 not published within 0.5s (index has v4)"
    waiting = cluster.readers[1].pull.call_one("exact", 5, 20.0, None, True)
    time.sleep(0.3)
    _, published[5] = owner.publish.call_one(5).get(timeout=60)
    assert waiting.get(timeout=60)["checksums"] == published[5]
    got = cluster.readers[0].pull.call_one("exact", 3, None, None, True).get(timeout=60)
    assert got["version"] == 3 and got["checksums"] == published[3]  # older than the latest, still kept
    owner.close.call_one().get(timeout=30)


def test_reclaim_keeps_a_leased_shared_arena_until_release_then_reuses_it(cluster):
    version = describe(cluster)["latest"]
    handle, lease = cluster.index.acquire.call_one("policy", version, None, 1.0, 60.0).get(timeout=10)
    assert handle.parts[0].host == host_identity() and handle.parts[0].local is not None
    stats, published = cluster.pub.publish.call_one(version + 1).get(timeout=60)
    assert version not in stats.reclaimed
    assert all(got["checksums"] == published for got in pull_all(cluster))
    assert local_checksums(handle) == checksums(make_state_dict(version))  # the leased bytes are intact

    cluster.index.release.call_one("policy", version, lease).get(timeout=10)
    stats, published = cluster.pub.publish.call_one(version + 2).get(timeout=60)
    assert stats.reclaimed == (version, version + 1)  # v+1 once superseded, unread
    newest, lease = cluster.index.acquire.call_one("policy", version + 2, None, 1.0, 60.0).get(timeout=10)
    cluster.index.release.call_one("policy", version + 2, lease).get(timeout=10)
    assert newest.parts[0].local.name == handle.parts[0].local.name  # the released version's arena holds the new one
    assert all(got["checksums"] == published for got in pull_all(cluster))


def test_transport_rdma_publisher_shares_no_memory_and_shm_readers_refuse_it(cluster):
    pid = cluster.pub.pid.call_one().get(timeout=10)
    before = segments_of(pid)
    rdma = CFG.model_copy(update={"transport": "rdma"})
    owner = cluster.meshes["pub"].spawn("rdma_owner", Publisher, "rdma-only", rdma)
    _, published = owner.publish.call_one(1).get(timeout=60)
    assert segments_of(pid) == before
    for got in pull_all(cluster, "rdma-only"):
        assert got["transport"] == "rdma" and got["checksums"] == published
    with pytest.raises(ActorError) as info:
        cluster.readers[0].pull.call_one("rdma-only", 0, None, {"transport": "shm"}).get(timeout=30)
    assert str(info.value.exception) == (
        "weight pull of 'rdma-only' v1 failed: transport 'shm' but the publisher shares no arena "
        "(its transport is 'rdma', or /dev/shm was unusable)"
    )


def test_auto_falls_back_to_rdma_when_the_segment_cannot_be_opened(cluster):
    owner = cluster.meshes["pub"].spawn("hidden_owner", Publisher, "hidden", CFG)
    pid = owner.pid.call_one().get(timeout=10)
    before = segments_of(pid)
    _, published = owner.publish.call_one(1).get(timeout=60)
    (segment,) = segments_of(pid) - before
    os.unlink(os.path.join(SHM_DIR, segment))  # the publisher still maps it; no reader can open it
    got_all = pull_all(cluster, "hidden")
    assert [got["transport"] for got in got_all] == ["rdma"] * 3
    assert all(got["checksums"] == published for got in got_all)
    with pytest.raises(ActorError) as info:
        cluster.readers[0].pull.call_one("hidden", 0, None, {"transport": "shm"}).get(timeout=30)
    msg = str(info.value.exception)
    assert msg.startswith(f"weight pull of 'hidden' v1 failed: shared-memory segment {segment} could not be opened")
    assert "\n" not in msg


def test_segments_of_a_killed_publisher_are_refused_then_removed(cluster):
    pm = this_host().spawn_procs(per_host={"procs": 1})
    owner = pm.spawn("publisher", Publisher, "stale", CFG)
    owner.publish.call_one(1).get(timeout=60)
    pid = owner.pid.call_one().get(timeout=10)
    stale = segments_of(pid)
    assert len(stale) == 1
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments_of(pid) == stale  # SIGKILL: nobody unlinked it
    start = time.monotonic()
    with pytest.raises(ActorError) as info:
        cluster.readers[0].pull.call_one("stale").get(timeout=30)
    assert time.monotonic() - start < 2
    assert str(info.value.exception) == (
        f"weight pull of 'stale' v1 failed: the publisher process of shared-memory segment {min(stale)} is gone"
    )
    try:
        pm.stop().get(timeout=10)
    except Exception:
        pass
    # the next segment created on this host sweeps it; a restarted owner serves its own bytes
    restarted = cluster.meshes["pub"].spawn("stale_owner", Publisher, "stale", CFG)
    _, published = restarted.publish.call_one(1).get(timeout=60)
    assert segments_of(pid) == set()
    assert all(got["checksums"] == published for got in pull_all(cluster, "stale"))


def test_close_unlinks_the_segments_and_readers_unmap_them(cluster):
    owner = cluster.meshes["pub"].spawn("closing_owner", Publisher, "closing", CFG)
    pid = owner.pid.call_one().get(timeout=10)
    before = segments_of(pid)
    for version in (1, 2):
        _, published = owner.publish.call_one(version).get(timeout=60)
        assert all(got["checksums"] == published for got in pull_all(cluster, "closing"))
    created = segments_of(pid) - before
    assert len(created) == 2 and created <= cluster.readers[0].mapped_segments.call_one().get(timeout=10)
    owner.close.call_one().get(timeout=30)
    assert not segments_of(pid) & created
    with pytest.raises(ActorError):  # the versions were withdrawn; the pull still drops stale mappings
        cluster.readers[0].pull.call_one("closing", 3, 0.2).get(timeout=30)
    assert not cluster.readers[0].mapped_segments.call_one().get(timeout=10) & created


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_arenas_are_copied_over_cuda_ipc_on_one_host(cluster):
    cuda = CFG.model_copy(update={"arena_device": "cuda"})
    owner = cluster.meshes["pub"].spawn("cuda_owner", Publisher, "cuda", cuda)
    _, published = owner.publish.call_one(1).get(timeout=60)
    got = cluster.readers[0].pull.call_one("cuda", 0, None, {"arena_device": "cuda"}).get(timeout=60)
    assert got["transport"] == "cuda_ipc" and got["checksums"] == published


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process that sees no GPU")
def test_a_process_without_a_gpu_reads_gpu_arenas_over_rdma_and_keeps_its_buffers_on_the_cpu(cluster):
    """A mesh placed on the CPU beside a learner on the host's GPU (`arena_device: cuda`): a GPU
    arena's CUDA IPC handle cannot be opened there, so transport auto reads it over RDMA and shm
    refuses it in one line; the reader's own buffers stay on the CPU, and its pulls work."""
    gpu_arena = CudaIpcRef(rebuild=torch.empty, args=())
    assert local_transport("auto", host_identity(), gpu_arena) is None
    with pytest.raises(SameHostUnavailable, match="in GPU memory and this process sees no GPU"):
        local_transport("shm", host_identity(), gpu_arena)
    version = describe(cluster)["latest"] + 1
    _, published = cluster.pub.publish.call_one(version).get(timeout=60)
    for overrides in ({"arena_device": "cuda"}, {"arena_device": "cuda", "transport": "rdma"}):
        got = cluster.readers[0].pull.call_one("policy", version, None, overrides).get(timeout=60)
        assert got["version"] == version and got["checksums"] == published


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


@pytest.mark.slow  # ~8 s on 2 cores
def test_pull_from_a_dead_owner_raises_within_the_timeout(cluster):
    crash_pm = this_host().spawn_procs(per_host={"procs": 1})
    crashy = crash_pm.spawn("publisher", Publisher, "crashy", CFG)
    crashy.publish.call_one(1).get(timeout=60)
    crashy.crash.broadcast()
    time.sleep(0.5)
    start = time.monotonic()
    pulls = [cluster.readers[r].pull.call_one("crashy", 0, None, o) for r, o in PULLS]
    for pull, transport in zip(pulls, EXPECTED_TRANSPORTS):
        with pytest.raises(ActorError) as info:
            pull.get(timeout=30)
        assert isinstance(info.value.exception, WeightSyncError)
        msg = str(info.value.exception)
        assert "\n" not in msg, msg
        if transport == "shm":  # the dead owner's shared memory is refused at once
            assert msg.startswith("weight pull of 'crashy' v1 failed: the publisher process of "), msg
        else:
            assert msg.startswith("weight pull of 'crashy' v1 chunk "), msg
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


def _spawn_ranks(store: str, cfg: WeightSyncConfig, world: int, ranks=None):
    """Publisher ranks of one store, each in a process of its own: {rank: (proc mesh, actor)}."""
    out = {}
    for rank in ranks if ranks is not None else range(world):
        pm = this_host().spawn_procs(per_host={"procs": 1})
        out[rank] = (pm, pm.spawn("shard_publisher", ShardPublisher, store, cfg, rank, world))
    return out


def _stop(meshes):
    for pm, _ in meshes.values():
        try:
            pm.stop().get(timeout=30)
        except Exception:
            pass


@pytest.mark.slow  # ~13 s on 2 cores
def test_a_sharded_version_appears_once_every_rank_published_and_readers_assemble_it(cluster):
    cfg = CFG.model_copy(update={"max_arenas": 3})
    ranks = _spawn_ranks("sharded", cfg, 2)
    try:
        stats, published = ranks[0][1].publish.call_one(1).get(timeout=60)
        assert not stats.complete and stats.nbytes < 0.6 * stats.total_bytes
        assert describe(cluster, "sharded")["versions"] == [] and describe(cluster, "sharded")["pending"] == {1: [0]}
        with pytest.raises(ActorError) as info:
            cluster.readers[0].pull.call_one("sharded", 1, 0.3).get(timeout=30)
        assert str(info.value.exception) == "weight pull of 'sharded': no version >= v1 within 0.3s (index has no version)"
        stats, _ = ranks[1][1].publish.call_one(1).get(timeout=60)
        assert stats.complete and describe(cluster, "sharded")["versions"] == [1]
        got_all = pull_all(cluster, "sharded")
        assert [got["transport"] for got in got_all] == EXPECTED_TRANSPORTS
        assert all(got["checksums"] == published and got["version"] == 1 for got in got_all)

        # bucket by bucket (each 1 MiB projection alone, the tied pair together), sync and async
        got = cluster.readers[0].pull_buckets.call_one("sharded", 1, {"pull_bucket_mib": 1}).get(timeout=60)
        assert got["checksums"] == published and len(got["buckets"]) > 4
        assert ["embed.weight", "head.weight"] in got["buckets"]
        got = cluster.readers[1].pull_buckets.call_one("sharded", 1, {"pull_bucket_mib": 1}).get(timeout=60)
        assert got["checksums"] == published and got["transport"] == "shm"
        got = cluster.readers[0].pull_buckets.call_one("sharded", 1, {"pull_bucket_mib": 1, "transport": "rdma"}
                                                       ).get(timeout=60)
        assert got["checksums"] == published and got["transport"] == "rdma"
        cuts = {"layers.1.proj.weight": TensorSlice(1, 256, 128), "embed.weight": TensorSlice(0, 500, 250)}
        sd = make_state_dict(1)
        narrowed = checksums({k: v.narrow(cuts[k].dim, cuts[k].start, cuts[k].length) if k in cuts else v
                              for k, v in sd.items()})
        for overrides in ({"pull_bucket_mib": 1}, {"pull_bucket_mib": 1, "transport": "rdma"}):
            got = cluster.readers[0].pull_buckets.call_one("sharded", 1, overrides, cuts).get(timeout=60)
            assert got["checksums"] == {**narrowed, "head.weight": narrowed["embed.weight"]}  # tied: sliced alike

        # v2 is left incomplete and superseded by v3: never visible, forgotten, its arena freed
        ranks[0][1].publish.call_one(2).get(timeout=60)
        for rank in (0, 1):
            _, published = ranks[rank][1].publish.call_one(3).get(timeout=60)
        assert describe(cluster, "sharded")["pending"] == {} and describe(cluster, "sharded")["versions"] == [3]
        assert ranks[0][1].versions.call_one().get(timeout=30) == [3]
        assert all(got["version"] == 3 and got["checksums"] == published for got in pull_all(cluster, "sharded"))

        # parts of different learners (another size, or a restarted one) never complete a version together
        three = ranks[0][0].spawn("rank0_of_3", ShardPublisher, "worlds", CFG, 0, 3)
        two = ranks[1][0].spawn("rank1_of_2", ShardPublisher, "worlds", CFG, 1, 2)
        three.publish.call_one(1).get(timeout=60)
        two.publish.call_one(1).get(timeout=60)
        assert describe(cluster, "worlds")["pending"] == {1: [1]}
        restarted = ranks[0][0].spawn("rank0_restarted", ShardPublisher, "worlds", CFG, 0, 2, "restarted")
        restarted.publish.call_one(1).get(timeout=60)
        assert describe(cluster, "worlds")["pending"] == {1: [0]} and describe(cluster, "worlds")["versions"] == []
    finally:
        _stop(ranks)


@pytest.mark.slow
def test_killed_publisher_ranks_and_readers_leave_no_torn_version(cluster):
    ranks = _spawn_ranks("torn", CFG, 2)
    reader_pm = this_host().spawn_procs(per_host={"procs": 1})
    try:
        for rank in (0, 1):
            _, published = ranks[rank][1].publish.call_one(1).get(timeout=60)
        assert all(got["version"] == 1 and got["checksums"] == published for got in pull_all(cluster, "torn"))
        # rank 1 dies before publishing its part of v2: v2 is never visible; readers keep v1 whole
        ranks[0][1].publish.call_one(2).get(timeout=60)
        os.kill(ranks[1][1].pid.call_one().get(timeout=10), signal.SIGKILL)
        assert all(got["version"] == 1 and got["nbytes"] == 0 for got in pull_all(cluster, "torn"))
        with pytest.raises(ActorError) as info:
            cluster.readers[1].pull.call_one("torn", 2, 0.3, None, True).get(timeout=30)
        assert "v2 not published within 0.3s (index has v1)" in str(info.value.exception)
        with pytest.raises(ActorError) as info:  # a new reader cannot fetch v1's dead part: a clear error
            cluster.readers[1].pull.call_one("torn", 1, None, {"transport": "shm"}).get(timeout=30)
        assert str(info.value.exception).startswith("weight pull of 'torn' v1 failed: the publisher process of ")
        _stop({1: ranks.pop(1)})
        ranks.update(_spawn_ranks("torn", CFG, 2, [1]))  # rank 1 restarted in its group completes v2
        _, published = ranks[1][1].publish.call_one(2).get(timeout=60)
        assert all(got["version"] == 2 and got["checksums"] == published for got in pull_all(cluster, "torn"))

        # a reader killed in the middle of a bucketed pull: its lease keeps v2 until it expires,
        # the others read whole versions meanwhile, then v2's arenas are reclaimed
        slow = reader_pm.spawn("slow_reader", SlowReader, CFG)
        slow_pid = slow.pid.call_one().get(timeout=30)  # asked first: the actor serves one call at a time
        slow.pull_slowly.broadcast("torn", 2)
        deadline = time.monotonic() + 30
        while describe(cluster, "torn")["leases"].get(2, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert describe(cluster, "torn")["leases"] == {2: 1}
        os.kill(slow_pid, signal.SIGKILL)
        for rank in (0, 1):
            stats, published = ranks[rank][1].publish.call_one(3).get(timeout=60)
            assert 2 not in stats.reclaimed  # still leased by the dead reader
        assert all(got["version"] == 3 and got["checksums"] == published for got in pull_all(cluster, "torn"))
        time.sleep(CFG.transfer_timeout_s + 5 + 2 * CFG.rpc_timeout_s)  # the lease's length (see WeightPuller)
        assert ranks[0][1].versions.call_one().get(timeout=30) == [3]
        assert describe(cluster, "torn")["versions"] == [3]
    finally:
        _stop(ranks)
        _stop({0: (reader_pm, None)})
