"""Delayed results over real Monarch ports: the inbox lives in this (controller) process,
echo producers in their own processes."""

import os

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import json  # noqa: E402
import time  # noqa: E402

import monarch.actor  # noqa: E402
import pytest  # noqa: E402
from monarch.actor import this_host  # noqa: E402

from meshrl.config.replay import ReplayPoolConfig
from meshrl.transport.delayed import DelayedInbox, DelayedMessage  # noqa: E402
from meshrl.testing.replay_actors import EchoProducer  # noqa: E402

pytestmark = pytest.mark.monarch

RPC_S = 30


@pytest.fixture(scope="module")
def pool():
    """Two echo producers ("pool/0", "pool/1") on one proc mesh."""
    faults = []
    default_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    pm = this_host().spawn_procs(per_host={"procs": 2})
    producers = pm.spawn("echo", EchoProducer, "pool")
    producers.stats.call().get(timeout=60)
    yield producers
    try:
        pm.stop().get(timeout=30)
    finally:
        monarch.actor.unhandled_fault_hook = default_hook


@pytest.fixture
def inbox(pool):
    box = DelayedInbox()
    pool.subscribe.call(box.port).get(timeout=RPC_S)
    yield box
    box.close()


def one(producers, rank: int):
    return producers.slice(procs=rank)


def drain_until(inbox, count: int, version: int = 0, lag: int = 100, timeout_s: float = 20.0) -> list[DelayedMessage]:
    """Poll ``drain`` until ``count`` messages were received (accepted or not)."""
    got: list[DelayedMessage] = []
    deadline = time.monotonic() + timeout_s
    start = inbox.stats()["received"]
    while inbox.stats()["received"] - start < count:
        assert time.monotonic() < deadline, f"only {inbox.stats()['received'] - start}/{count} arrived"
        got += inbox.drain(version, lag)
        time.sleep(0.02)
    return got


def send_acks(inbox, producers) -> None:
    for producer, keys in inbox.acks().items():
        rank = int(producer.rsplit("/", 1)[1])
        one(producers, rank).ack.call_one(keys).get(timeout=RPC_S)


def unacked(producers) -> list[int]:
    return [s["unacked"] for s in producers.stats.call().get(timeout=RPC_S).values()]


def test_messages_arrive_in_order_per_producer_and_acks_empty_the_outboxes(pool, inbox):
    for i in range(10):
        for rank in (0, 1):
            one(pool, rank).submit.call_one(f"order-{rank}-{i}", f"ep-{i}", 0, {"i": i}).get(timeout=RPC_S)
    got = drain_until(inbox, 20)
    assert len(got) == 20
    for rank in (0, 1):
        mine = [m for m in got if m.producer == f"pool/{rank}"]
        assert [m.key for m in mine] == [f"order-{rank}-{i}" for i in range(10)]
        assert [m.payload for m in mine] == [{"i": i} for i in range(10)]
        assert [m.seq for m in mine] == sorted(m.seq for m in mine)
    assert unacked(pool) == [10, 10]
    acks = inbox.acks()
    assert {p: len(k) for p, k in acks.items()} == {"pool/0": 10, "pool/1": 10}
    for producer, keys in acks.items():
        one(pool, int(producer[-1])).ack.call_one(keys).get(timeout=RPC_S)
    assert unacked(pool) == [0, 0]
    assert inbox.acks() == {}


def test_stale_results_beyond_the_version_lag_are_dropped_and_counted(pool, inbox):
    for version in range(6):
        one(pool, 0).submit.call_one(f"stale-{version}", "ep", version).get(timeout=RPC_S)
    got = drain_until(inbox, 6, version=5, lag=2)
    assert [m.policy_version for m in got] == [3, 4, 5]
    stats = inbox.stats()
    assert (stats["accepted"], stats["stale_dropped"]) == (3, 3)
    acks = inbox.acks()
    assert len(acks["pool/0"]) == 6  # stale ones are acknowledged too: the producer drops them
    assert one(pool, 0).ack.call_one(acks["pool/0"]).get(timeout=RPC_S) == 6
    # the horizon never moves back: an older current version does not revive stale results
    one(pool, 0).submit.call_one("stale-late", "ep", 2).get(timeout=RPC_S)
    assert drain_until(inbox, 1, version=0, lag=0) == []
    assert inbox.stats()["stale_dropped"] == 4
    send_acks(inbox, pool)


def test_duplicate_keys_are_accepted_once(pool, inbox):
    for rank in (0, 1):  # two producers send the same key
        one(pool, rank).submit.call_one("dup-a", "ep", 0).get(timeout=RPC_S)
    assert [m.key for m in drain_until(inbox, 2)] == ["dup-a"]
    # re-subscribing the same port re-sends everything unacknowledged: all duplicates now
    resent = pool.subscribe.call(inbox.port).get(timeout=RPC_S)
    assert list(resent.values()) == [1, 1]
    assert drain_until(inbox, 2) == []
    assert inbox.stats()["duplicates"] == 3
    assert sorted(inbox.acks().items()) == [("pool/0", ["dup-a", "dup-a"]), ("pool/1", ["dup-a", "dup-a"])]
    pool.ack.call(["dup-a"]).get(timeout=RPC_S)
    assert unacked(pool) == [0, 0]


def test_replaced_consumer_gets_every_unacknowledged_message_and_no_acknowledged_one(pool):
    old = DelayedInbox()
    pool.subscribe.call(old.port).get(timeout=RPC_S)
    for i in range(3):
        one(pool, 0).submit.call_one(f"cons-acked-{i}", "ep", 1).get(timeout=RPC_S)
    assert len(drain_until(old, 3)) == 3
    send_acks(old, pool)
    for i in range(3):  # received by the old inbox's thread but never drained: lost with it
        one(pool, 0).submit.call_one(f"cons-undrained-{i}", "ep", 1).get(timeout=RPC_S)
    deadline = time.monotonic() + 10
    while old._queue.qsize() < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    state = json.loads(json.dumps(old.state_dict()))  # as it would be checkpointed
    old.close()
    one(pool, 1).submit.call_one("cons-while-down", "ep", 1).get(timeout=RPC_S)  # nobody listens

    new = DelayedInbox()
    try:
        new.load_state_dict(state)
        resent = pool.subscribe.call(new.port).get(timeout=RPC_S)
        assert list(resent.values()) == [3, 1]
        got = drain_until(new, 4)
        assert sorted(m.key for m in got) == [*(f"cons-undrained-{i}" for i in range(3)), "cons-while-down"]
        assert new.stats()["duplicates"] == 0
        send_acks(new, pool)
        assert unacked(pool) == [0, 0]
        assert new.stats()["accepted"] == 3 + 4  # counters carried over from the old inbox
    finally:
        new.close()
    # the send to the closed inbox came back undeliverable: counted by the producer, not lost
    deadline = time.monotonic() + 45
    while one(pool, 1).stats.call_one().get(timeout=RPC_S)["undeliverable"] < 1:
        assert time.monotonic() < deadline, "undeliverable send never reported"
        time.sleep(0.2)


def test_replaced_producer_gets_its_outstanding_work_again_nothing_lost_or_accepted_twice(inbox):
    cfg = ReplayPoolConfig(procs=1)
    pm = this_host().spawn_procs(per_host={"procs": cfg.procs})
    producer = pm.spawn("echo", EchoProducer, "solo")
    producer.subscribe.call_one(inbox.port).get(timeout=60)
    work = {"fast-acked": 0.0, "fast-undrained": 0.0, "slow-1": 30.0, "slow-2": 30.0}
    inbox.expect("fast-acked", "solo/0")
    producer.submit.call_one("fast-acked", "ep", 0, "fast-acked").get(timeout=RPC_S)
    assert [m.key for m in drain_until(inbox, 1)] == ["fast-acked"]
    for key in ("fast-undrained", "slow-1", "slow-2"):
        inbox.expect(key, "solo/0")
        producer.submit.call_one(key, "ep", 0, key, work[key]).get(timeout=RPC_S)
    time.sleep(0.3)  # "fast-undrained" reaches the inbox's queue but is not drained yet
    assert inbox.outstanding("solo/0") == ["fast-undrained", "slow-1", "slow-2"]
    pm.stop().get(timeout=30)  # the producer dies with its unacked and unfinished work

    pm = this_host().spawn_procs(per_host={"procs": cfg.procs})
    try:
        producer = pm.spawn("echo", EchoProducer, "solo")
        assert producer.subscribe.call_one(inbox.port).get(timeout=60) == 0
        for key in inbox.outstanding("solo/0"):
            producer.submit.call_one(key, "ep", 0, key).get(timeout=RPC_S)
        got = drain_until(inbox, 4)  # the old "fast-undrained" plus three re-submitted results
        assert sorted(m.payload for m in got) == ["fast-undrained", "slow-1", "slow-2"]
        assert inbox.outstanding() == []
        counts = inbox.stats()["by_producer"]["solo/0"]
        assert counts == {"received": 5, "accepted": 4, "stale_dropped": 0, "duplicates": 1}
        send_acks(inbox, producer)
        assert producer.stats.call_one().get(timeout=RPC_S)["unacked"] == 0
    finally:
        pm.stop().get(timeout=30)


def test_drain_never_blocks(pool, inbox):
    started = time.perf_counter()
    assert inbox.drain(0, 0) == []
    assert time.perf_counter() - started < 0.05
    one(pool, 0).submit.call_one("slow-one", "ep", 0, None, 2.0).get(timeout=RPC_S)  # arrives in 2 s
    for i in range(300):
        one(pool, 1).submit.call_one(f"burst-{i}", "ep", 0).get(timeout=RPC_S)
    time.sleep(0.3)
    started = time.perf_counter()
    got = inbox.drain(0, 0)
    took = time.perf_counter() - started
    assert 0 < len(got) <= 300 and "slow-one" not in [m.key for m in got]
    assert took < 0.1, f"drain of {len(got)} messages took {took:.3f}s"
    drain_until(inbox, 301 - len(got))
    send_acks(inbox, pool)


def test_state_dict_round_trips_through_json_and_rejects_other_formats(inbox):
    inbox.expect("k1", "p/0")
    state = inbox.state_dict()
    assert json.loads(json.dumps(state)) == state
    with pytest.raises(ValueError, match="format"):
        inbox.load_state_dict({**state, "format": 99})
