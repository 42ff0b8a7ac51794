"""The three terms in one learner step, end to end: real Monarch processes, the tiny model, an
SDPO teacher actor, and three real HTTP teachers on loopback (one of them failing) replaying
traces to the replay pool, their results arriving late."""

import pytest

from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training
from meshrl.testing.fake_openai import Fault, FakeOpenAIServer

pytestmark = pytest.mark.monarch


def _teachers(url, extra=""):
    entries = [f"{{name: t{i}, base_url: '{url}', model: m{i}, timeout_s: 5, max_retries: 1, backoff_base_s: 0.1,"
               f" backoff_max_s: 0.2{extra}}}" for i in range(3)]
    return "replay.teachers.teachers=[" + ", ".join(entries) + "]"


def _run(cfg, session=None, actors=None):
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir, session=session, actors=actors)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


COMMON = ["trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.export_final=false",
          "trainer.checkpoint.every=0"]


@pytest.mark.slow  # ~14 s on 2 cores
def test_full_arm_trains_on_all_three_terms(tiny_run_config, tiny_session):
    """The replay pairs' reference log-probabilities come from the reference actor (the default
    `replay.reference.source: precomputed`): the learner, made to fail if it is ever asked for its
    frozen reference model, trains the DPO term all the same."""
    from meshrl.testing.mesh_actors import LearnerWithoutReference

    script = {"m0": "The answer is 42.", "m1": "42", "m2": Fault("server_error"), "hinter": "Hint: add carefully."}
    with FakeOpenAIServer(script) as server:
        hinter = f"sdpo.hint_generator={{enabled: true, endpoint: {{name: h, base_url: '{server.base_url}', model: hinter}}}}"
        cfg = tiny_run_config("output.name=full", "trainer.steps=4", *COMMON, "sdpo.alpha=0.5", "sdpo.teacher=mesh",
                              "replay.beta=0.5", "replay.pool.procs=1", _teachers(server.base_url), hinter)
        train = _run(cfg, tiny_session, actors={"learner": LearnerWithoutReference})
        requests = server.chat_requests("m0")
    assert len(train) == 4
    assert any(r["loss/grpo"] != 0 for r in train)
    assert any(r["loss/sdpo_jsd"] > 0 for r in train)
    assert any(r["loss/replay_dpo"] > 0 for r in train), [r.get("replay/dpo_items") for r in train]
    for r in train:
        expected = r["loss/grpo"] + 0.5 * r["loss/sdpo_jsd"] + 0.5 * r["loss/replay_dpo"]
        assert r["loss/total"] == pytest.approx(expected)
    last = train[-1]
    assert last["sdpo/error_sites"] > 0 and last["sdpo/hints"] > 0
    assert last["sdpo/llm_hints"] > 0 and last["sdpo/llm_hint_ok"] > 0  # the optional LLM hint generator
    assert last["replay/submitted"] > 0 and last["replay/dpo_items"] > 0
    # every pair that arrived is scored once, or waits for its call (which runs beside the steps)
    assert last["replay/reference_scored"] + last["replay/reference_pending"] == last["replay/dpo_items"]
    assert last["replay/failures/server_error"] > 0  # the failing teacher is counted, training went on
    # every teacher saw the student's exact context (the default system prompt included)
    assert requests and requests[0].body["messages"][0]["role"] == "system"


@pytest.mark.slow  # ~18 s on 2 cores
def test_sdpo_teacher_in_the_learner_with_alpha_warmup(tiny_run_config, tiny_session):
    """`sdpo.teacher: learner` spawns no teacher mesh and pulls nothing more; the warm-up keeps the
    first step's SDPO weight at 0 (nothing scored), then the term trains on the error sites: it
    scores twice its budget (`candidates_per_site`) and trains the budget's worth, and the budget
    follows the measured cost (`cost_share`) under its ceiling."""
    cfg = tiny_run_config("output.name=learner-teacher", "trainer.steps=4", *COMMON, "sdpo.alpha=0.4",
                          "sdpo.teacher=learner", "sdpo.alpha_warmup_steps=2", "sdpo.token_clip=5",
                          "sdpo.max_sites_per_step=4", "sdpo.candidates_per_site=2", "sdpo.cost_share=0.01")
    train = _run(cfg, tiny_session)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[0]["loss/sdpo_jsd"] == 0 and "sdpo/error_sites" not in train[0]
    for r, weight in zip(train[1:], (0.2, 0.4, 0.4)):  # the warm-up: 0, alpha / 2, alpha
        assert r["sdpo/hints"] > 0 and r["loss/sdpo_jsd"] > 0 and r["timing/sdpo_teacher_s"] > 0
        assert r["loss/total"] == pytest.approx(r["loss/grpo"] + weight * r["loss/sdpo_jsd"])
        assert 0 <= r["sdpo/token_clip_frac"] <= 1
        assert not any(k.startswith("sync/sdpo_teacher") for k in r)
        assert 1 <= r["sdpo/trained_sites"] <= r["sdpo/site_budget"] <= 4 and r["sdpo/cost_s"] > 0
        assert r["sdpo/trained_sites"] < r["sdpo/scored_sites"] <= 2 * r["sdpo/site_budget"]
        assert r["sdpo/disagreement_kept"] >= r["sdpo/disagreement_dropped"]
    assert train[1]["sdpo/site_budget"] == 4 and train[3]["sdpo/site_budget"] < 4  # 1 % of a step buys fewer


# slow tier: a run with the terms' weights at 0 builds only the policy-gradient term
# (test_terms checks the terms a config builds), so this repeats the baseline run twice over
@pytest.mark.slow
def test_zero_weights_reproduce_the_baseline_exactly(tiny_run_config):
    baseline = _run(tiny_run_config("output.name=baseline", "trainer.steps=2", *COMMON))
    with FakeOpenAIServer({"m0": "1", "m1": "1", "m2": "1"}) as server:
        zeroed = _run(tiny_run_config("output.name=zeroed", "trainer.steps=2", *COMMON, "sdpo.alpha=0",
                                      "replay.beta=0", _teachers(server.base_url)))
        assert server.chat_requests("m0") == []  # a disabled channel costs nothing
    for a, b in zip(baseline, zeroed):
        assert a["loss/total"] == b["loss/total"] == a["loss/grpo"]
        assert a["reward/mean"] == b["reward/mean"]
        assert not any(k.startswith(("sdpo/", "replay/")) for k in b)
