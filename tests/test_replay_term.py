"""The trace-replay term's step budget and pair buffer, over a scripted teacher pool.

The pool is a stand-in that records submissions; results come back through a real delayed outbox
(in this process) into the term's real inbox, so the term's own drain, buffer and datums run."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import json

from meshrl.actors.teacher_replay import TraceReplayOutcome
from meshrl.losses.preference import REFERENCE_INPUT
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.replay.agreement import PreferencePair
from meshrl.replay.trace import ReplayPair
from meshrl.terms.base import TermContext
from meshrl.terms.replay import ReplayTerm, spread_over_groups, unit_quota
from meshrl.training.trajectories import Trajectory
from meshrl.transport.delayed import DelayedOutbox

TEACHERS = "replay.teachers.teachers=[{name: a, base_url: 'http://127.0.0.1:9/v1', model: a}, " \
           "{name: b, base_url: 'http://127.0.0.1:9/v1', model: b}]"


class _Endpoint:
    def __init__(self, calls: list, name: str, rank: int):
        self.calls, self.name, self.rank = calls, name, rank

    def call_one(self, *args):
        self.calls.append((self.name, self.rank, args))

    def call(self, *args):
        self.calls.append((self.name, None, args))


class ScriptedPool:
    """Records what the term asks of the pool (submit, ack, subscribe)."""

    def __init__(self, procs: int):
        self.extent = SimpleNamespace(labels=["procs"], sizes=[procs])
        self.calls: list = []
        self.subscribe = _Endpoint(self.calls, "subscribe", -1)

    def slice(self, procs: int):
        return SimpleNamespace(submit=_Endpoint(self.calls, "submit", procs), ack=_Endpoint(self.calls, "ack", procs))

    def submitted(self) -> list[str]:
        return [args[0] for name, _, args in self.calls if name == "submit"]


class FakeReference:
    """The reference mesh: each answer's 'log-probability' is minus its length plus the prompt's
    first token / 100 (easy to check), one actor per rank."""

    def __init__(self, procs: int):
        self.extent = SimpleNamespace(labels=["procs"], sizes=[procs])
        self.calls: list[int] = []  # pairs per call
        self.gate = threading.Event()  # a call answers once it is set
        self.gate.set()
        self.failure: Exception | None = None  # what the next call raises

    def slice(self, procs: int):
        def score(pairs, temperature):
            assert self.gate.wait(timeout=10)
            if self.failure is not None:
                raise self.failure
            self.calls.append(len(pairs))
            return {"references": [[-len(c) + p[0] / 100, -len(r) + p[0] / 100] for p, c, r in pairs], "seconds": 0.0}

        return SimpleNamespace(score_pairs=SimpleNamespace(call_one=score))


class ScriptedClient:
    def __init__(self, pool: ScriptedPool, reference: FakeReference):
        self.meshes = {"teacher_replay": pool, "replay_reference": reference}
        self.sup = SimpleNamespace(on_respawn=lambda mesh, fn: None)
        self.step = 0

    def procs(self, mesh):
        return self.meshes[mesh].extent.sizes[0]

    def call(self, mesh, what, issue, name, timeout_s):
        return issue(self.meshes[mesh])

    def unsupervised(self, mesh, issue, what, timeout_s=None):
        return issue(self.meshes[mesh])


@dataclass
class Unit:
    sampled: list


@pytest.fixture
def make_term(smollm_tokenizer):
    from meshrl.renderers import renderer_for_tokenizer

    renderer = renderer_for_tokenizer(smollm_tokenizer)
    terms = []

    def make(*overrides):
        cfg = load_config(RunConfig, None, ["replay.beta=0.1", TEACHERS, *overrides])
        pool = ScriptedPool(cfg.replay.pool.procs)
        client = ScriptedClient(pool, FakeReference(cfg.replay.reference.mesh.procs))
        term = ReplayTerm(TermContext(cfg, client, renderer))
        terms.append(term)
        return term, pool

    yield make
    for term in terms:
        term.close()


def failing(unit: int, groups: int, per_group: int, version: int = 0) -> list[Trajectory]:
    problem = SimpleNamespace(messages=[{"role": "user", "content": "What is 2 + 2?"}])
    return [Trajectory(id=f"u{unit}-g{g}-{i}", group=g, problem=problem, prompt_tokens=[1, 2, 3],
                       tokens=[5, 6, 2], logprobs=[-1.0] * 3, mask=[1] * 3, version=version,
                       response_text="5", info={"correct": False})
            for g in range(groups) for i in range(per_group)]


def test_the_budget_is_per_step_shared_by_its_units_and_what_it_leaves_out_is_counted(make_term):
    term, pool = make_term("replay.traces_per_step=8", "trainer.num_minibatches=2", "trainer.prompts_per_step=4")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=8)))  # 16 failures
    term.receive(Unit(failing(1, groups=2, per_group=8)))  # 16 more
    keys = pool.submitted()
    assert len(keys) == 8
    assert sum("/u0-" in k for k in keys) == 4 and sum("/u1-" in k for k in keys) == 4
    assert sum("-g0-" in k for k in keys) == sum("-g1-" in k for k in keys) == 4  # spread over the groups
    assert term.drain(1)["replay/skipped_budget"] == 24
    term.start_step(2)  # a new step, a new budget
    term.receive(Unit(failing(2, groups=1, per_group=3)))
    term.receive(Unit(failing(3, groups=1, per_group=9)))
    assert len(pool.submitted()) == 8 + 3 + 5  # the first unit's unused share goes to the next
    assert term.counts["skipped_budget"] == 24 + 4


def test_unit_quota_and_spread_over_groups():
    assert [unit_quota(8, sent, i, 3) for sent, i in ((0, 0), (3, 1), (6, 2))] == [3, 3, 2]
    assert unit_quota(8, 8, 3, 3) == 0 and unit_quota(8, 5, 4, 3) == 3  # an extra round takes what is left
    trajectories = failing(0, groups=3, per_group=2)
    trajectories.sort(key=lambda t: t.id)
    assert [t.id for t in spread_over_groups(trajectories, 4)] == ["u0-g0-0", "u0-g1-0", "u0-g2-0", "u0-g0-1"]
    assert spread_over_groups([], 3) == []


def deliver(term: ReplayTerm, pool: ScriptedPool, version: int) -> None:
    """Every submitted trace comes back with one pair (a chosen answer the student did not give)."""
    outbox = DelayedOutbox("teacher_replay/0")
    outbox.subscribe(term.inbox.port)
    for key in pool.submitted():
        pair = ReplayPair(key, 0, [], PreferencePair("4", "5", "4", "5", 2, 2, 2, ("a", "b")))
        outbox.send(key, TraceReplayOutcome([pair]), episode_id=key, step=-1, policy_version=version)
    deadline = time.monotonic() + 30
    while term.inbox._queue.qsize() < len(pool.submitted()) and time.monotonic() < deadline:
        time.sleep(0.05)


def scored(term: ReplayTerm, version: int) -> dict:
    """Drain until the pairs that arrived have their reference values and sit in the buffer (their
    scoring call runs beside the step); the last drain's metrics."""
    metrics = term.drain(version)
    while term.scoring is not None:
        term.scoring[0].result(timeout=10)
        metrics = term.drain(version)
    return metrics


def test_buffered_pairs_are_dropped_and_counted_once_too_old_and_the_buffer_is_bounded(make_term):
    term, pool = make_term("replay.traces_per_step=8", "replay.max_pairs_per_step=2", "replay.pool.max_version_lag=1")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=4, per_group=2, version=3)))
    deliver(term, pool, version=3)
    scored(term, 3)
    datums, metrics = term.datums(3)
    # 8 pairs arrived; the buffer keeps 2 x (1 + 1) = 4 of them, the newest; a step trains 2
    assert metrics["replay/dpo_items"] == 8 and metrics["replay/pairs_overflow"] == 4
    assert len(datums) == 2 * 2 and len(term.buffer) == 2
    assert all(float(d.loss_fn_inputs["weight"]) == pytest.approx(0.1 / 2) for d in datums)
    datums, metrics = term.datums(5)  # the remaining pairs' traces (version 3) are now 2 versions old
    assert datums == [] and term.buffer == []
    assert metrics["replay/pairs_stale"] == 2


def _expected_reference(item):
    return [-len(item.chosen) + item.prompt[0] / 100, -len(item.rejected) + item.prompt[0] / 100]


def test_pairs_are_scored_once_beside_the_step_and_their_datums_carry_the_reference(make_term):
    term, pool = make_term("replay.traces_per_step=8", "replay.max_pairs_per_step=2", "replay.reference.mesh.procs=2",
                           "replay.reference.beside_the_step=true")
    reference = term.client.meshes["replay_reference"]
    reference.gate.clear()  # the scoring call hangs until the test lets it answer
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    started = time.monotonic()
    datums, metrics = term.datums(1)  # the step goes on while its 4 new pairs are scored
    assert time.monotonic() - started < 5 and datums == [] and term.buffer == []
    assert metrics["replay/reference_pending"] == 4 and metrics["replay/dpo_items"] == 4
    waiting = json.loads(json.dumps(term.state_dict()))  # a checkpoint keeps the pairs that wait
    assert [i["reference"] for i in waiting["buffer"]] == [None] * 4
    term.start_step(2)
    term.receive(Unit(failing(1, groups=1, per_group=2, version=1)))  # 2 more arrive while the call runs
    deliver(term, pool, version=1)
    assert term.drain(1)["replay/reference_pending"] == 6 and len(term.scoring[1]) == 4  # one call at a time
    reference.gate.set()
    term.scoring[0].result(timeout=10)
    reference.gate.clear()  # the next call waits again, so that what ran so far can be checked
    datums, metrics = term.datums(1)  # the 4 enter the buffer, 2 train; a call for the other 2 starts
    assert sorted(reference.calls) == [2, 2]  # the 4 pairs, split over the reference mesh's two ranks
    assert metrics["replay/reference_scored"] == 4 and len(term.buffer) == 2
    assert metrics["replay/reference_pending"] == 2 and len(term.scoring[1]) == 2
    for item in term.buffer:
        assert item.reference == pytest.approx(_expected_reference(item))
    chosen, rejected = datums[0], datums[1]  # the first pair trained, chosen then rejected
    values = [float(chosen.loss_fn_inputs[REFERENCE_INPUT]), float(rejected.loss_fn_inputs[REFERENCE_INPUT])]
    prompt_first = chosen.model_input.to_ints()[0]
    n_chosen = int(chosen.loss_fn_inputs["mask"].sum())
    n_rejected = int(rejected.loss_fn_inputs["mask"].sum())
    assert values == pytest.approx([-n_chosen + prompt_first / 100, -n_rejected + prompt_first / 100])
    reference.gate.set()
    metrics = scored(term, 1)
    assert sorted(reference.calls) == [1, 1, 2, 2] and metrics["replay/reference_scored"] == 6  # each pair once
    assert metrics["replay/reference_pending"] == 0 and len(term.buffer) == 4

    resumed, _ = make_term("replay.traces_per_step=8", "replay.reference.mesh.procs=2")
    resumed.load_state_dict(waiting)  # the pairs that waited are scored as the checkpoint loads
    assert [v for i in resumed.buffer for v in i.reference] == \
        pytest.approx([v for i in resumed.buffer for v in _expected_reference(i)])
    assert len(resumed.buffer) == 4 and resumed.scoring is None


def test_a_failed_scoring_call_fails_the_step_that_collects_it(make_term):
    term, pool = make_term("replay.traces_per_step=4", "replay.reference.beside_the_step=true")
    reference = term.client.meshes["replay_reference"]
    reference.failure = RuntimeError("replay_reference.score_pairs: timed out after 120 s")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    term.drain(1)
    with pytest.raises(RuntimeError, match="score_pairs: timed out"):
        term.scoring[0].result(timeout=10)
    with pytest.raises(RuntimeError, match="score_pairs: timed out"):
        term.drain(1)


def test_by_default_the_drain_waits_for_the_scoring_and_its_pairs_train_the_same_step(make_term):
    term, pool = make_term("replay.traces_per_step=4", "replay.max_pairs_per_step=4")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    metrics = term.drain(1)  # the call is made and waited for here, before the step
    assert term.scorer is None and term.scoring is None and len(term.buffer) == 4
    assert metrics["replay/reference_scored"] == 4 and metrics["replay/reference_pending"] == 0
    assert metrics["timing/replay_reference_s"] > 0
    for item in term.buffer:
        assert item.reference == pytest.approx(_expected_reference(item))
    datums, _ = term.datums(1)
    assert len(datums) == 2 * 4 and term.client.meshes["replay_reference"].calls == [4]
    reference = term.client.meshes["replay_reference"]
    reference.failure = RuntimeError("replay_reference.score_pairs: timed out after 120 s")
    term.start_step(2)
    term.receive(Unit(failing(1, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    with pytest.raises(RuntimeError, match="score_pairs: timed out"):  # the step that drains them fails
        term.drain(1)


def test_the_learner_source_spawns_nothing_and_its_datums_have_no_reference(make_term):
    term, pool = make_term("replay.traces_per_step=4", "replay.reference.source=learner")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    datums, metrics = term.datums(1)
    assert term.client.meshes["replay_reference"].calls == [] and "replay/reference_scored" not in metrics
    assert datums and all(REFERENCE_INPUT not in d.loss_fn_inputs for d in datums)


def test_a_resumed_buffer_keeps_its_references_and_an_old_checkpoint_is_scored_on_load(make_term):
    term, pool = make_term("replay.traces_per_step=4", "replay.max_pairs_per_step=1")
    term.start_step(1)
    term.receive(Unit(failing(0, groups=2, per_group=2, version=1)))
    deliver(term, pool, version=1)
    scored(term, 1)
    state = json.loads(json.dumps(term.state_dict()))  # as a checkpoint stores it
    assert [i["reference"] for i in state["buffer"]] == [i.reference for i in term.buffer]

    resumed, _ = make_term("replay.traces_per_step=4", "replay.max_pairs_per_step=1")
    resumed.load_state_dict(state)
    assert [i.reference for i in resumed.buffer] == [i.reference for i in term.buffer]
    assert resumed.client.meshes["replay_reference"].calls == []  # nothing to compute again

    old = json.loads(json.dumps(state))
    for item in old["buffer"]:
        del item["reference"]  # a checkpoint written before pairs carried references
    from_old, _ = make_term("replay.traces_per_step=4", "replay.max_pairs_per_step=1")
    from_old.load_state_dict(old)
    assert from_old.client.meshes["replay_reference"].calls == [len(old["buffer"])]
    assert [v for i in from_old.buffer for v in i.reference] == \
        pytest.approx([v for i in from_old.buffer for v in _expected_reference(i)])

    by_learner, _ = make_term("replay.traces_per_step=4", "replay.reference.source=learner")
    by_learner.load_state_dict(state)  # a run that switched to the learner's reference drops the values
    assert all(i.reference is None for i in by_learner.buffer)
    assert all(REFERENCE_INPUT not in d.loss_fn_inputs for d in by_learner.step_datums())


def test_the_reference_mesh_is_placed_beside_the_pool_and_never_in_the_learner():
    from meshrl.config.base import ConfigError
    from meshrl.meshes.placement import run_slots

    slots = {s.name: s.key for s in run_slots(load_config(RunConfig, None, ["replay.beta=0.1", TEACHERS]))}
    assert slots["replay_reference"] == "replay.reference.mesh"
    by_learner = load_config(RunConfig, None, ["replay.beta=0.1", TEACHERS, "replay.reference.source=learner"])
    assert "replay_reference" not in {s.name for s in run_slots(by_learner)}
    with pytest.raises(ConfigError, match="the reference would sit in the learner's memory"):
        load_config(RunConfig, None, ["replay.beta=0.1", TEACHERS, "replay.reference.mesh.colocate_with=learner"])
