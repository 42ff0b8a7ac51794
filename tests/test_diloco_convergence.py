"""DiLoCo on the synthetic supervised task: 2 replicas that synchronise every H inner steps reach
the eval loss of one model trained on the same samples with a synchronisation every step, with
H-fold fewer synchronisations; and with one replica, outer lr 1 and no momentum, DiLoCo is plain
training."""

import math

import pytest
import torch

from meshrl.diloco.executors import LocalProcessExecutor, ReplicaSpec
from meshrl.diloco.store import encode_tensors
from benchmarks.diloco_toy import (DIM_IN, STUDENT_HIDDEN, make_batch, make_student, make_teacher, run_replica,
                                      train_single)

ROUNDS, H, BATCH, LR = 20, 10, 32, 3e-3
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.5}  # see benchmarks/diloco.py for the paper's 0.7 / 0.9


def test_the_data_streams_are_seeded_per_replica_and_step():
    teacher = make_teacher(0)
    x, y = make_batch(teacher, 0, 1, 5, 4)
    assert torch.equal(x, make_batch(teacher, 0, 1, 5, 4)[0]) and x.shape == (4, DIM_IN) and y.shape == (4, 1)
    assert not torch.equal(x, make_batch(teacher, 0, 0, 5, 4)[0])  # another replica
    assert not torch.equal(x, make_batch(teacher, 0, 1, 6, 4)[0])  # another step
    a, b = make_student(0), make_student(0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sum(p.numel() for p in a.parameters()) == DIM_IN * STUDENT_HIDDEN + STUDENT_HIDDEN + STUDENT_HIDDEN + 1


def test_one_replica_with_outer_lr_1_and_no_momentum_is_plain_training(tmp_path):
    out = run_replica(0, 1, f"file://{tmp_path}", rounds=3, inner_steps=4, batch_size=8, lr=LR, outer_lr=1.0,
                      outer_momentum=0.0, poll_interval_s=0.01)
    single = train_single(12, 8, LR, eval_every=4)
    assert out["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert out["eval"] == pytest.approx(single["eval"], rel=1e-5)


@pytest.mark.slow  # ~5 s on 2 cores
def test_two_replicas_match_one_model_on_the_same_samples_with_h_fold_fewer_syncs(tmp_path):
    spec = ReplicaSpec("benchmarks.diloco_toy:run_replica",
                       {"store_url": f"file://{tmp_path}/store", "rounds": ROUNDS, "inner_steps": H,
                        "batch_size": BATCH, "lr": LR, "poll_interval_s": 0.01, **OUTER})
    with LocalProcessExecutor(tmp_path / "work") as ex:
        ex.launch_replicas(spec, 2)
        results = ex.collect(timeout_s=120)
    a, b = results[0].result, results[1].result
    assert a is not None and b is not None, [r.error for r in results.values()]
    single = train_single(ROUNDS * H, BATCH, LR, streams=2, eval_every=H)

    assert a["hashes"] == b["hashes"] and a["eval"] == b["eval"]
    syncs = len(a["rounds"])
    assert syncs == ROUNDS and single["steps"] == H * syncs  # one sync per H steps vs one per step
    assert a["samples"] + b["samples"] == single["samples"] == 2 * ROUNDS * H * BATCH
    ratio = a["eval"][-1] / single["eval"][-1]
    print(f"final eval loss: DiLoCo {a['eval'][-1]:.5f}, single {single['eval'][-1]:.5f}, ratio {ratio:.4f}; "
          f"bytes up/down per round and replica: {a['rounds'][-1]['bytes_up']}/{a['rounds'][-1]['bytes_down']}")
    assert abs(ratio - 1) <= 0.05

    # bytes per round: each replica uploads its fp32 delta once and downloads the other's
    delta_bytes = len(encode_tensors({k: torch.zeros_like(v) for k, v in make_student().state_dict().items()}))
    assert all(r["bytes_up"] == delta_bytes for o in (a, b) for r in o["rounds"])
    # ... plus, when it is the one proposing the seal, its own delta read back from the store
    assert all(r["bytes_down"] in (delta_bytes, 2 * delta_bytes) for o in (a, b) for r in o["rounds"])
    assert math.isclose(delta_bytes, 4 * sum(p.numel() for p in make_student().parameters()), rel_tol=0.1)
