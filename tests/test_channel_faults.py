"""Fault tolerance of the channel actors inside a real run: the SDPO teacher and the teacher
replay pool are SIGKILLed mid-run, a teacher reply is lost and the replay pairs' reference actor
fails a call; the run finishes every step with the events counted, the replacement pool inherits
the spend made so far and every pair still gets its reference values."""

import pytest

from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training
from meshrl.testing.fake_openai import FakeOpenAIServer
from tests.test_channels_e2e import COMMON, _teachers

pytestmark = pytest.mark.monarch


@pytest.mark.slow  # ~45 s on 2 cores
def test_channel_actors_are_replaced_and_lost_replies_resubmitted(tiny_run_config, tiny_session):
    faults = ("faults.inject=["
              "{mesh: teacher_replay, at_step: 1, action: drop, endpoint: submit},"
              "{mesh: sdpo_teacher, at_step: 2, action: kill, during: sdpo, seconds: 0},"
              "{mesh: teacher_replay, at_step: 3, action: kill, during: step_start},"
              "{mesh: replay_reference, at_step: 2, action: raise, endpoint: score_pairs}]")
    with FakeOpenAIServer({"m0": "42", "m1": "42", "m2": "41"}) as server:
        cfg = tiny_run_config("output.name=channel-faults", "trainer.steps=5", *COMMON, "sdpo.alpha=0.5",
                              "sdpo.teacher=mesh", "replay.beta=0.5", "replay.pool.procs=1", "replay.pool.result_timeout_s=3",
                              _teachers(server.base_url, ", price_completion_per_1m_usd: 1000"), faults)
        run_dir = make_run_dir(cfg, overwrite=True)
        run_training(cfg, run_dir, session=tiny_session)
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert sum(r["batch/groups"] for r in train) == 5 * cfg.trainer.prompts_per_step
    meshes = sorted(f["mesh"] for f in records if f["kind"] == "fault")
    assert meshes == ["replay_reference", "sdpo_teacher", "teacher_replay"]
    last = train[-1]
    assert last["faults/restarts/replay_reference"] == 1  # the failed scoring call was made again on a new actor
    assert last["replay/reference_scored"] + last["replay/reference_pending"] == last["replay/dpo_items"]
    assert last["faults/restarts/sdpo_teacher"] == 1 and last["faults/restarts/teacher_replay"] == 1
    assert any(r["loss/sdpo_jsd"] > 0 for r in train[2:])  # distillation resumed after the replacement
    assert last["replay/dpo_items"] > 0
    assert last["replay/resubmitted_lost"] + last.get("replay/resubmitted", 0) >= 1
    # the replacement pool was charged with the spend made before it, so the budget does not restart
    assert 0 < last["replay/spend_carried_usd"] < last["replay/cost_usd"]
