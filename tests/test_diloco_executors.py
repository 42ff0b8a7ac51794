"""DiLoCo replicas as separate jobs through the executors, over a file:// store and a real S3
endpoint (moto server on loopback): replicas end every round with identical weights, a replica
SIGKILLed mid-run is tolerated at quorum, a corrupt delta in the store is rejected and its round
goes on, and the Monarch-job executor runs replicas as hosts of a real ProcessJob."""

import json
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from meshrl.diloco.executors import ExecutorError, LocalProcessExecutor, ReplicaSpec, ServerlessExecutor
from meshrl.diloco.executors.base import read_lines
from meshrl.testing.s3_server import MotoS3Server

FAST = {"inner_steps": 5, "batch_size": 16, "poll_interval_s": 0.02, "round_timeout_s": 60}


@pytest.fixture(scope="module")
def s3():
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def store(request, tmp_path):
    """(store_url, storage_options) of a fresh store: `file` or `s3` (parametrized indirectly)."""
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    server = request.getfixturevalue("s3")
    return server.url(tmp_path.name), server.storage_options


TOY = "benchmarks.diloco_toy:run_replica"  # the synthetic supervised task of benchmarks/diloco.py


def _spec(store, entry=TOY, **kw) -> ReplicaSpec:
    url, options = store
    return ReplicaSpec(entry, {"store_url": url, "storage_options": options, **FAST, **kw})


def _wait_for_line(ex, replica: int, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in ex.stream_logs(replica)):
        assert time.monotonic() < deadline, f"replica {replica} never logged {text!r}"
        time.sleep(0.02)


def test_replica_spec_checks_its_entry_and_kwargs():
    with pytest.raises(ValueError, match="pkg.module:function"):
        ReplicaSpec("benchmarks.diloco_toy.run_replica")
    with pytest.raises(ValueError, match="JSON-able"):
        ReplicaSpec("a.b:c", {"x": object()})
    spec = ReplicaSpec("a.b:c", {"x": [1, 2]})
    assert ReplicaSpec.from_json(spec.to_json()) == spec


def test_read_lines_follows_a_file_until_the_writer_ends(tmp_path):
    path, done = tmp_path / "log", threading.Event()

    def write():
        with open(path, "w") as f:
            for chunk in ("a\nb", "c\n", "d"):
                f.write(chunk)
                f.flush()
                time.sleep(0.05)
        done.set()

    threading.Thread(target=write).start()
    assert list(read_lines(path, done.is_set, timeout_s=10, poll_s=0.01)) == ["a", "bc", "d"]
    with pytest.raises(ExecutorError, match="still running after 0s"):
        list(read_lines(path, lambda: False, timeout_s=0.05, poll_s=0.01))


# identical weights on file:// and S3 (moto) in the default suite; the other variants, the fault
# tests and the executors' own tests in the slow tier
SLOW = pytest.mark.slow


@pytest.mark.parametrize("store, n", [("file", 2), ("s3", 2), pytest.param("s3", 3, marks=SLOW)], indirect=["store"])
def test_replicas_end_every_round_with_identical_weights(store, n, tmp_path):
    """(3 replicas over file:// complete their rounds in the corrupt-delta test.)"""
    rounds = 3
    with LocalProcessExecutor(tmp_path / "work") as ex:
        assert isinstance(ex, ServerlessExecutor) and not ex.supports_inter_replica_network
        ex.launch_replicas(_spec(store, rounds=rounds), n)
        results = ex.collect(timeout_s=120)
        log = list(ex.stream_logs(n - 1, follow=True, timeout_s=5))
    assert [(r.status.state, r.status.exit_code, r.error) for r in results.values()] == [("succeeded", 0, None)] * n
    out = [results[i].result for i in range(n)]
    assert len(out[0]["hashes"]) == rounds and len(set(out[0]["hashes"])) == rounds
    assert all(o["hashes"] == out[0]["hashes"] for o in out)  # identical weights after every outer step
    assert all(o["eval"] == out[0]["eval"] for o in out)
    assert all(rep["participants"] == list(range(n)) for o in out for rep in o["rounds"])
    assert all(b > 0 for o in out for b in o["bytes"])
    assert f"replica {n - 1}: round {rounds} done, participants {list(range(n))}" in log[-1]
    assert json.loads((tmp_path / "work" / "replica-0.json").read_text())["result"]["hashes"] == out[0]["hashes"]


@pytest.mark.parametrize("store", ["file", "s3"], indirect=True)
@pytest.mark.slow  # each ~10 s on 2 cores
def test_a_replica_sigkilled_mid_run_is_tolerated_at_quorum(store, tmp_path):
    rounds = 6
    spec = _spec(store, rounds=rounds, quorum=2, straggler_wait_s=1.0)  # a round waits 1s for a missing replica
    with LocalProcessExecutor(tmp_path / "work") as ex:
        ex.launch_replicas(spec, 3)
        _wait_for_line(ex, 2, "round 2 done")
        victim = ex.pid(2)
        os.kill(victim, signal.SIGKILL)
        results = ex.collect(timeout_s=120)
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert (results[2].status.state, results[2].status.exit_code) == ("failed", -signal.SIGKILL)
    assert results[2].error == "failed: killed by SIGKILL" and results[2].result is None
    a, b = results[0].result, results[1].result
    assert results[0].status.state == results[1].status.state == "succeeded"
    # a replica that started over a second late joined at round 1's outer state: compare by round
    ha, hb = ({rep["round"]: rep["hash"] for rep in o["rounds"]} for o in (a, b))
    common = set(ha) & set(hb)
    assert rounds in common and all(ha[r] == hb[r] for r in common)
    parts = [rep["participants"] for rep in a["rounds"]]
    assert [0, 1, 2] in parts and parts[-1] == [0, 1]  # the last rounds go on without replica 2


@pytest.mark.parametrize("store", ["file", "s3"], indirect=True)
@pytest.mark.slow  # each ~10 s on 2 cores
def test_a_corrupt_delta_is_rejected_and_its_round_goes_on(store, tmp_path):
    """Replica 1 uploads a truncated delta in round 2 and commits it: the others (and replica 1
    itself, which verifies its stored delta before sealing) reject it; all average the rest."""
    spec = _spec(store, "meshrl.testing.diloco_faults:truncated_delta_replica", wrapped=TOY,
                 truncate_replica=1, truncate_round=2, rounds=4, quorum=2, straggler_wait_s=20)
    # (a long straggler wait: a replica that starts late would otherwise miss round 1 and catch up)
    with LocalProcessExecutor(tmp_path / "work") as ex:
        ex.launch_replicas(spec, 3)
        results = ex.collect(timeout_s=120)
        logs = [line for i in range(3) for line in ex.stream_logs(i)]
    out = [results[i].result for i in range(3)]
    assert all(r.status.state == "succeeded" for r in results.values()), [r.error for r in results.values()]
    assert out[0]["hashes"] == out[1]["hashes"] == out[2]["hashes"]
    assert [rep["participants"] for rep in out[1]["rounds"]] == [[0, 1, 2], [0, 2], [0, 1, 2], [0, 1, 2]]
    assert any("round 2: skipping replica 1's delta: checksum mismatch" in line for line in logs)
    assert sum(o["rounds"][1]["rejected_total"] for o in out) >= 1  # at least by whoever sealed round 2


@pytest.mark.slow  # ~6 s on 2 cores
def test_cancel_kills_only_the_replicas_process_group(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        with LocalProcessExecutor(tmp_path / "work") as ex:
            ex.launch_replicas(_spec((f"file://{tmp_path}/store", {}), rounds=10_000), 2)
            _wait_for_line(ex, 0, "round 1 done")
            ex.cancel(0)
            assert ex.poll()[0].state == "cancelled" and ex.poll()[1].state == "running"
            ex.cancel()
            results = ex.collect(timeout_s=10)
        assert [r.status.state for r in results.values()] == ["cancelled", "cancelled"]
        assert results[0].error == "cancelled: killed by SIGKILL"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_a_replica_that_raises_fails_with_its_error_line(tmp_path):
    with LocalProcessExecutor(tmp_path / "work") as ex:
        ex.launch_replicas(ReplicaSpec("benchmarks.diloco_toy:run_replica", {"store_url": ""}), 1)
        [result] = ex.collect(timeout_s=60).values()
    assert (result.status.state, result.status.exit_code) == ("failed", 1)
    assert result.error.startswith("ValidationError: 1 validation error for DiLoCoConfig")


@pytest.mark.monarch
@pytest.mark.slow  # ~7 s on 2 cores
def test_monarch_job_executor_runs_two_replicas_as_hosts_of_a_process_job(tmp_path):
    from meshrl.diloco.executors.monarch_job import MonarchJobExecutor
    from meshrl.launch.process import replica_job

    with MonarchJobExecutor(tmp_path / "work", replica_job) as ex:
        assert isinstance(ex, ServerlessExecutor)
        ex.launch_replicas(_spec((f"file://{tmp_path}/store", {}), rounds=3), 2)
        workers = ex.launcher.worker_pids()
        assert len(workers) == 2  # a host (worker process) per replica
        log = list(ex.stream_logs(1, follow=True, timeout_s=120))
        results = ex.collect(timeout_s=60)
    assert all(r.status.state == "succeeded" for r in results.values()), [r.error for r in results.values()]
    a, b = results[0].result, results[1].result
    assert a["hashes"] == b["hashes"] and len(a["hashes"]) == 3
    assert log[-1].startswith("replica 1: round 3 done, participants [0, 1]")
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers.values()):
        assert time.monotonic() < deadline, "the job's host workers outlived the executor"
        time.sleep(0.1)
