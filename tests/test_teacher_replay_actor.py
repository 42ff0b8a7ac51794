"""Teacher replay pool with real Monarch processes and real HTTP: two TeacherReplayActors on their
own proc mesh, three teachers on a loopback OpenAI-compatible server (one of them faulty, a
different fault per trace), results on the delayed-result channel drained by this controller."""

import os

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import getpass  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import monarch.actor  # noqa: E402
import pytest  # noqa: E402
from monarch.actor import this_host  # noqa: E402

from meshrl.actors.teacher_replay import TraceReplayOutcome, producer_name  # noqa: E402
from meshrl.transport.delayed import DelayedInbox  # noqa: E402
from meshrl.config.replay import ReplayPoolConfig, TeacherPanelConfig  # noqa: E402
from meshrl.replay.trace import Trace, TraceStep  # noqa: E402
from meshrl.testing.replay_actors import LoggedTeacherReplayActor  # noqa: E402
from meshrl.testing.fake_openai import FakeOpenAIServer, Fault  # noqa: E402

pytestmark = pytest.mark.monarch

RPC_S = 30
SECRET = "sk-meshrl-test-" + "Zq8vW2xK" * 4
KEY_ENV = "MESHRL_TEST_TEACHER_KEY"
FAULTY_TIMEOUT_S = 0.5
FAULT_FOR_MODE = {
    "slow": Fault("slow", 2.0, text="<answer>42</answer>"),  # past the faulty teacher's timeout
    "rate_limit": Fault("rate_limit", 0.05),
    "server_error": Fault("server_error"),
    "malformed_json": Fault("malformed_json"),
    "bad_schema": Fault("bad_schema"),
    "reset": Fault("reset"),
}
ERROR_KIND = {"slow": "timeout", "rate_limit": "rate_limited", "server_error": "server_error",
              "malformed_json": "malformed_json", "bad_schema": "bad_schema", "reset": "connection"}
CHANNEL = ReplayPoolConfig(procs=2, max_traces_in_flight=2, max_version_lag=2)
VERSION = 3


def script(model: str, messages: list[dict]) -> str | Fault:
    mode = re.search(r"mode=(\w+)", messages[-1]["content"]).group(1)
    if model == "faulty" and mode in FAULT_FOR_MODE:
        return FAULT_FOR_MODE[mode]
    return "<answer>42</answer>"


def make_trace(episode_id: str, mode: str, student: str = "41", steps: int = 2) -> Trace:
    system = {"role": "system", "content": "Answer with <answer>N</answer>."}
    return Trace(episode_id, [
        TraceStep([system, {"role": "user", "content": f"mode={mode} step={i}: what is 6 * 7?"}], student)
        for i in range(steps)
    ])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    os.environ[KEY_ENV] = SECRET  # inherited by the actor processes
    log_path = tmp_path_factory.mktemp("teacher_replay") / "actors.log"
    monarch_log = Path(f"/tmp/{getpass.getuser()}/monarch_log.log")
    monarch_log_start = monarch_log.stat().st_size if monarch_log.exists() else 0
    faults = []
    default_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    server = FakeOpenAIServer(script, api_key=SECRET).start()
    teacher = dict(base_url=server.base_url, api_key_env=KEY_ENV, max_retries=1, backoff_base_s=0.01,
                   backoff_max_s=0.05, jitter=False, timeout_s=5.0, price_prompt_per_1m_usd=1.0)
    replay_cfg = TeacherPanelConfig(teachers=[
        {**teacher, "name": "good-a", "model": "good-a"},
        {**teacher, "name": "good-b", "model": "good-b"},
        {**teacher, "name": "faulty", "model": "faulty", "timeout_s": FAULTY_TIMEOUT_S},
    ], agreement_k=2)
    ns = type("Setup", (), {})()
    ns.server, ns.faults, ns.replay_cfg, ns.inbox = server, faults, replay_cfg, DelayedInbox()
    ns.log_path, ns.monarch_log, ns.monarch_log_start = log_path, monarch_log, monarch_log_start
    spawn_pool(ns)
    yield ns
    try:
        ns.inbox.close()
        ns.pm.stop().get(timeout=30)
    finally:
        server.stop()
        monarch.actor.unhandled_fault_hook = default_hook
        os.environ.pop(KEY_ENV, None)


def spawn_pool(setup) -> None:
    """(Re)create the pool and subscribe it to the inbox."""
    setup.pm = this_host().spawn_procs(per_host={"procs": CHANNEL.procs})
    setup.pool = setup.pm.spawn(
        "teacher_replay", LoggedTeacherReplayActor, str(setup.log_path), setup.replay_cfg, CHANNEL
    )
    infos = list(setup.pool.info.call().get(timeout=60).values())
    setup.pids = [info["pid"] for info in infos]
    setup.actor_of = {info["producer"]: setup.pool.slice(procs=rank) for rank, info in enumerate(infos)}
    assert sorted(setup.actor_of) == [producer_name("teacher_replay", r) for r in range(CHANNEL.procs)]
    assert set(setup.pool.subscribe.call(setup.inbox.port).get(timeout=RPC_S).values()) == {0}


def submit_all(setup, work: dict[str, tuple[Trace, int]]) -> list[float]:
    """Round-robin over the pool; returns the time each submit took."""
    producers = sorted(setup.actor_of)
    took = []
    for i, (key, (trace, version)) in enumerate(work.items()):
        producer = producers[i % len(producers)]
        setup.inbox.expect(key, producer)
        started = time.perf_counter()
        assert setup.actor_of[producer].submit.call_one(key, trace, version).get(timeout=RPC_S) is True
        took.append(time.perf_counter() - started)
    return took


def drain_all(setup, timeout_s: float = 40.0):
    """Drain until nothing is outstanding; returns (messages, arrival time per key, (start, duration)
    of every drain)."""
    messages, arrived, drains = [], {}, []
    deadline = time.monotonic() + timeout_s
    while setup.inbox.outstanding():
        assert time.monotonic() < deadline, f"still outstanding: {setup.inbox.outstanding()}"
        started = time.monotonic()
        batch = setup.inbox.drain(VERSION, CHANNEL.max_version_lag)
        drains.append((started, time.monotonic() - started))
        messages += batch
        arrived.update({m.key: time.monotonic() for m in batch})
        time.sleep(0.02)
    return messages, arrived, drains


def ack_all(setup) -> None:
    for producer, keys in setup.inbox.acks().items():
        setup.actor_of[producer].ack.call_one(keys).get(timeout=RPC_S)


def pool_stats(setup) -> list[dict]:
    return list(setup.pool.stats.call().get(timeout=RPC_S).values())


def test_every_trace_yields_one_message_with_the_expected_pairs_and_failures_counted(setup, capfd):
    work = {f"work-{mode}": (make_trace(f"ep-{mode}", mode), VERSION) for mode in FAULT_FOR_MODE}
    work["work-clean"] = (make_trace("ep-clean", "none"), VERSION)
    work["work-student-right"] = (make_trace("ep-right", "none", student="<answer>42</answer>"), VERSION)
    work["work-broken"] = (Trace("ep-broken", [None]), VERSION)  # replay itself fails
    work["work-old-policy"] = (make_trace("ep-old", "none"), VERSION - CHANNEL.max_version_lag - 1)
    submitted_at = time.monotonic()
    submit_s = submit_all(setup, work)
    assert max(submit_s) < 1.0, f"submit blocked for {max(submit_s):.2f}s"  # training never waits

    messages, arrived, drains = drain_all(setup)
    longest = max(seconds for _, seconds in drains)
    assert longest < 0.1, f"a drain took {longest:.3f}s"
    assert arrived["work-slow"] - submitted_at > 2 * FAULTY_TIMEOUT_S
    assert sum(1 for started, _ in drains if started < arrived["work-slow"]) >= 10  # polled while slow

    stats = setup.inbox.stats()
    assert (stats["received"], stats["duplicates"], stats["stale_dropped"]) == (len(work), 0, 1)
    by_key = {m.key: m for m in messages}
    assert len(messages) == len(by_key) == len(work) - 1 and "work-old-policy" not in by_key
    for key, message in by_key.items():
        trace, version = work[key]
        assert (message.episode_id, message.policy_version, message.step) == (trace.episode_id, version, -1)
        assert isinstance(message.payload, TraceReplayOutcome)

    for mode, kind in ERROR_KIND.items():
        outcome = by_key[f"work-{mode}"].payload
        assert outcome.error is None
        assert [(p.episode_id, p.step_index, p.chosen, p.rejected) for p in outcome.pairs] == [
            (f"ep-{mode}", i, "<answer>42</answer>", "41") for i in range(2)
        ]
        assert outcome.metrics[f"replay/failures/{kind}"] == 2, (mode, outcome.metrics)
    assert len(by_key["work-clean"].payload.pairs) == 2
    assert not any(k.startswith("replay/failures") for k in by_key["work-clean"].payload.metrics)
    assert by_key["work-student-right"].payload.pairs == []
    broken = by_key["work-broken"].payload
    assert broken.pairs == [] and broken.error.startswith("AttributeError")

    per_actor = pool_stats(setup)
    assert sum(s["replay_errors"] for s in per_actor) == 1
    assert sum(s["replayed"] for s in per_actor) == len(work) - 1
    failures = sum((Counter(s["teacher_failures"]) for s in per_actor), Counter())
    assert failures == Counter({kind: 2 for kind in ERROR_KIND.values()})
    assert all(1 <= s["peak_running"] <= CHANNEL.max_traces_in_flight for s in per_actor)
    assert sum(s["spend"]["calls"] for s in per_actor) > 0
    assert all(s["unacked"] > 0 for s in per_actor)
    ack_all(setup)
    assert all(s["unacked"] == 0 and s["running"] == s["queued"] == 0 for s in pool_stats(setup))

    # the key was really sent, and appears in no output of the actors or of this process
    assert any(r.headers.get("Authorization") == f"Bearer {SECRET}" for r in setup.server.chat_requests())
    actor_output = setup.log_path.read_text()
    assert "teacher faulty" in actor_output  # the actors' warnings were captured
    assert SECRET not in actor_output
    captured = capfd.readouterr()
    assert SECRET not in captured.out and SECRET not in captured.err
    if setup.monarch_log.exists():
        with setup.monarch_log.open("rb") as f:
            f.seek(setup.monarch_log_start)
            assert SECRET.encode() not in f.read()


def test_a_key_already_in_flight_or_unacked_is_not_replayed_twice(setup):
    key = "work-twice"
    producer = sorted(setup.actor_of)[0]
    actor = setup.actor_of[producer]
    setup.inbox.expect(key, producer)
    assert actor.submit.call_one(key, make_trace("ep-twice", "slow"), VERSION).get(timeout=RPC_S) is True
    assert actor.submit.call_one(key, make_trace("ep-twice", "slow"), VERSION).get(timeout=RPC_S) is False
    messages, _, _ = drain_all(setup)
    assert [m.key for m in messages] == [key]
    assert actor.submit.call_one(key, make_trace("ep-twice", "none"), VERSION).get(timeout=RPC_S) is False  # unacked
    ack_all(setup)
    stats = actor.stats.call_one().get(timeout=RPC_S)
    assert stats["duplicate_submissions"] == 2 and stats["unacked"] == 0


def test_a_crashed_pool_is_replaced_and_its_outstanding_traces_resubmitted(setup):
    work = {f"crash-{i}": (make_trace(f"ep-crash-{i}", "slow"), VERSION) for i in range(4)}
    submit_all(setup, work)
    time.sleep(0.3)  # every trace is waiting on the slow teacher
    os.kill(setup.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 15
    while not setup.faults:
        assert time.monotonic() < deadline, "the crash was never reported"
        time.sleep(0.1)
    try:
        setup.pm.stop().get(timeout=30)
    except Exception:  # a partly dead mesh may fail to stop cleanly: drop it
        pass
    lost = setup.inbox.outstanding()  # nothing drained yet: all four (the killed actor's never arrive)
    assert lost == list(work)

    spawn_pool(setup)
    producers = sorted(setup.actor_of)
    for key in lost:
        producer = producers[int(key.rsplit("-", 1)[1]) % len(producers)]
        setup.inbox.expect(key, producer)
        setup.actor_of[producer].submit.call_one(key, *work[key]).get(timeout=RPC_S)
    messages, _, _ = drain_all(setup)
    assert Counter(m.key for m in messages) == Counter(list(work))  # each exactly once
    assert all(len(m.payload.pairs) == 2 for m in messages)
    ack_all(setup)
