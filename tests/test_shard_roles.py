"""Generation as separate jobs (`diloco.role`), over fake meshes and a real file:// store: a
generation job writes every step's groups as a shard and trains nothing; a learner of shards trains
on exactly those tokens (in (index, producer) order, resumable from its checkpointed position,
bad shards skipped and counted, stale groups dropped, a one-line error when no shard comes); a
generation job of a DiLoCo run follows the run's newest outer state every `inner_steps` steps."""

import json
from pathlib import Path

import pytest
import torch

from meshrl.config.base import load_config
from meshrl.config.diloco import DiLoCoConfig
from meshrl.config.run import RunConfig
from meshrl.controller.shard_source import ShardSource, ShardsTimeout, trajectory_from_record
from meshrl.diloco.replica import ModelSync
from meshrl.diloco.shards import ShardReader, ShardWriter, rollout_record
from meshrl.diloco.store import ObjectStore
from meshrl.replay.pairs import PreferenceItem, preference_record
from meshrl.terms import TermContext
from meshrl.terms.base import finish_terms
from meshrl.terms.replay import ShardPairsTerm
from meshrl.testing.fake_meshes import make_loop
from meshrl.training.trajectories import Trajectory
from tests.test_diloco_learner import DiLoCoFakeLearner

ROOT = Path(__file__).resolve().parents[1]


def _loop(store, role, learner=None, **more):
    overrides = {"trainer.prompts_per_step": 2, "trainer.group_size": 2, "diloco.store_url": store,
                 "diloco.role": role, "diloco.poll_interval_s": 0.02, "diloco.round_timeout_s": 30,
                 "diloco.shard_wait_s": 2, **more}
    return make_loop(learner=learner, **overrides)


def _trained_tokens(learner):
    """Per forward_backward call, the token ids of its datums."""
    return [[d.model_input.to_ints() for d in call[1]] for call in learner.calls if call[0] == "fb"]


def _traj(i, group, reward, n=3):
    return Trajectory(id=f"t{i}", group=group, problem=None, prompt_tokens=[1, 2], tokens=[10 + i] * n,
                      logprobs=[-0.5] * n, mask=[1] * n, version=0, reward=reward, info={"correct": reward > 0})


def test_a_generation_job_writes_its_groups_and_a_learner_of_shards_trains_on_exactly_them(tmp_path):
    store = f"file://{tmp_path}"
    gen, _, gen_learner = _loop(store, "generate", **{"diloco.replica_id": 5, "trainer.group_size": 4})
    gen_metrics = [gen.step()[0] for _ in range(3)]
    gen.close()
    assert not [c for c in gen_learner.calls if c[0] in ("fb", "opt")]  # a generation job trains nothing
    assert [m["shards/index"] for m in gen_metrics] == [0, 1, 2]
    shards = list(ShardReader(ObjectStore(store), "diloco").shards())
    assert [(s.producer, s.manifest["step"]) for s in shards] == [("gen5", 1), ("gen5", 2), ("gen5", 3)]
    groups = [[r for r in s.records if r["group"] == g] for s in shards for g in sorted({r["group"] for r in s.records})]
    assert len(groups) == 6

    # 3 groups a step: the learner's units straddle the shards
    learn, _, learner = _loop(store, "learn", **{"trainer.prompts_per_step": 3, "trainer.num_minibatches": 1,
                                                 "trainer.advantage.drop_uniform_groups": "false"})
    steps = [learn.step() for _ in range(2)]
    trained = [t for _, ts in steps for t in ts]
    assert [t.id for t in trained] == [f"gen5/{r['id']}" for g in groups for r in g]
    for t, r in zip(trained, [r for g in groups for r in g]):  # token-exact, the sampler's logprobs kept
        assert (t.prompt_tokens, t.tokens, t.logprobs, t.mask, t.reward) == (
            r["prompt_tokens"], r["tokens"], r["logprobs"], r["mask"], r["reward"])
        assert t.info["sampler_version"] == r["version"]
    datums = [toks for call in _trained_tokens(learner) for toks in call]
    def group_mean(t, ts):
        rewards = [x.reward for x in ts if x.group == t.group]
        return sum(rewards) / len(rewards)

    # a datum for every sampled trajectory with a non-zero group-relative advantage
    with_signal = [t for _, ts in steps for t in ts if t.sampled_tokens and t.reward != group_mean(t, ts)]
    assert with_signal and sorted(map(tuple, datums)) == sorted(tuple(t.prompt_tokens + t.tokens)[:-1]
                                                                for t in with_signal)
    assert [m["shards/groups_read"] for m, _ in steps] == [3, 3]
    assert "gen/tokens_per_s" not in steps[0][0]  # it sampled nothing

    with pytest.raises(ShardsTimeout, match="no new rollout shard .* within shard_wait_s = 2s"):
        learn.step()
    learn.close()


def test_a_resumed_learner_of_shards_continues_with_the_next_unused_group(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")
    for producer in ("gen0", "gen1"):
        writer = ShardWriter(store, "diloco", producer)
        for k in range(2):
            writer.write([rollout_record(_traj(10 * k + i, i // 2, float(i % 2)), k + 1) for i in range(4)], step=k + 1)
    uninterrupted, _, _ = _loop(f"file://{tmp_path}", "learn", **{"trainer.prompts_per_step": 3})
    expected = [[t.id for t in uninterrupted.step()[1]] for _ in range(2)]
    uninterrupted.close()
    # (index, producer) order: gen0's first shard, gen1's first, gen0's second ...
    assert [i.split("/")[0] for ids in expected for i in ids] == ["gen0"] * 4 + ["gen1"] * 4 + ["gen0"] * 4

    first, _, _ = _loop(f"file://{tmp_path}", "learn", **{"trainer.prompts_per_step": 3})
    assert [t.id for t in first.step()[1]] == expected[0]
    state = first.state_dict()
    first.close()
    resumed, _, _ = _loop(f"file://{tmp_path}", "learn", **{"trainer.prompts_per_step": 3})
    resumed.load_state_dict(state)
    assert [t.id for t in resumed.step()[1]] == expected[1]
    resumed.close()


def test_bad_shards_are_skipped_and_stale_groups_dropped_and_counted(tmp_path, caplog):
    store = ObjectStore(f"file://{tmp_path}")
    writer = ShardWriter(store, "diloco", "gen0", compression="none")
    writer.write([rollout_record(_traj(i, 0, float(i)), 1, diloco_round=0) for i in range(2)])  # stale at round 3
    writer.write([rollout_record(_traj(2, 0, 1.0), 1, diloco_round=3)])
    bad = writer.write([rollout_record(_traj(3, 0, 1.0), 1, diloco_round=3)])
    store.put(f"diloco/shards/{bad['object']}", b"{}\n")  # bytes changed under the manifest
    writer.write([{"id": "x", "group": 0}])  # a record without tokens
    writer.write([rollout_record(_traj(4 + i, 0, float(i)), 1, diloco_round=2) for i in range(2)])
    source = ShardSource(DiLoCoConfig(store_url=f"file://{tmp_path}", role="learn", shard_wait_s=1,
                                      poll_interval_s=0.01, max_rounds_behind=1))
    position = {}
    with caplog.at_level("WARNING"):
        groups, pairs, metrics = source.take(2, position, learner_round=3, version=7)
    assert [[t.id for t in g] for g in groups] == [["gen0/t2"], ["gen0/t4", "gen0/t5"]] and pairs == []
    assert all(t.version == 7 for g in groups for t in g)
    assert metrics["shards/stale_dropped"] == 2 and metrics["shards/rejected_total"] == 2 == source.rejected
    assert position == {"gen0": [4, 1]}
    assert "checksum mismatch" in caplog.text and "malformed record (KeyError" in caplog.text
    assert "sampled at round 0 for a learner at round 3" in caplog.text


def _sequence(datum):
    """The whole token sequence of a Datum (its inputs and the last target)."""
    return datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"][-1])]


def _pair(i):
    return PreferenceItem(f"v0/t{i}/0", prompt=[1, 2, i], chosen=[50 + i, 2], rejected=[60 + i, 2])


def test_teacher_pairs_travel_in_the_shards_and_are_handed_out_once_their_shard_is_used_up(tmp_path):
    """A generation job with the replay channel writes the teachers' pairs beside its groups; a
    learner of shards gets a shard's pairs when it has used up the shard's groups (so a resumed
    position never hands them out twice), a shard of pairs alone at once, and trains them as the
    replay channel's DPO term: at most max_pairs_per_step a step, weighted beta / pairs."""
    store = ObjectStore(f"file://{tmp_path}")
    writer = ShardWriter(store, "diloco", "gen0", compression="none")
    writer.write([rollout_record(_traj(0, 0, 1.0), 1), rollout_record(_traj(1, 1, 0.0), 1),
                  preference_record(_pair(0), 1)])
    writer.write([preference_record(_pair(1), 2)])  # a step whose groups all went elsewhere
    writer.write([rollout_record(_traj(2, 0, 1.0), 3), preference_record(_pair(2), 3),
                  {**preference_record(_pair(3), 3), "chosen": []}])  # an empty answer: a malformed shard
    writer.write([rollout_record(_traj(3, 0, 1.0), 4), preference_record(_pair(4), 4)])
    source = ShardSource(DiLoCoConfig(store_url=f"file://{tmp_path}", role="learn", shard_wait_s=1,
                                      poll_interval_s=0.01))
    position = {}
    groups, pairs, metrics = source.take(1, position, learner_round=0, version=0)
    assert [g[0].id for g in groups] == ["gen0/t0"] and pairs == [] and position == {"gen0": [0, 1]}
    groups, pairs, metrics = source.take(1, position, learner_round=0, version=0)
    assert [g[0].id for g in groups] == ["gen0/t1"] and [p.key for p in pairs] == ["gen0/v0/t0/0"]
    assert metrics["shards/pairs_read"] == 1
    groups, pairs, _ = source.take(1, position, learner_round=0, version=0)
    # shard 1 (pairs alone) at once, shard 2 skipped as malformed (its pairs with it), shard 3 used up
    assert [g[0].id for g in groups] == ["gen0/t3"] and [p.key for p in pairs] == ["gen0/v0/t1/0", "gen0/v0/t4/0"]
    assert source.rejected == 1
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == ([1, 2, 1], [51, 2], [61, 2])

    cfg = load_config(RunConfig, None, ["replay.beta=0.5", "replay.max_pairs_per_step=2", "diloco.role=learn",
                                        f"diloco.store_url=file://{tmp_path}"])  # no teachers of its own
    trained = []

    class Client:  # the step's shared learner pass, recorded
        def forward_backward_parts(self, parts):
            trained.extend((p.datums, p.loss_fn, p.loss_fn_config) for p in parts)
            return [{"loss": 0.5, "num_pairs": len(p.datums) / 2} for p in parts]

    class Unit:
        extras = {"pairs": [_pair(0), _pair(1), _pair(2)]}

    term = ShardPairsTerm(TermContext(cfg, Client(), None))
    term.receive(Unit())
    metrics = {}
    assert finish_terms([term], 3, metrics, Client()) == {"replay_dpo": 0.5}
    [(datums, loss_fn, config)] = trained
    assert (loss_fn, config) == ("dpo", {"beta": 0.1})
    assert [_sequence(d) for d in datums] == [[1, 2, 0, 50, 2], [1, 2, 0, 60, 2], [1, 2, 1, 51, 2], [1, 2, 1, 61, 2]]
    assert all(float(d.loss_fn_inputs["weight"]) == 0.25 for d in datums)  # beta / pairs
    assert metrics == {"replay/dpo_items": 2.0, "replay/buffered_pairs": 1.0, "dpo/num_pairs": 2.0}
    restored = ShardPairsTerm(TermContext(cfg, Client(), None))
    restored.load_state_dict(json.loads(json.dumps(term.state_dict())))
    finish_terms([restored], 4, {}, Client())
    assert [d.model_input.to_ints()[:3] for d in trained[1][0]] == [[1, 2, 2], [1, 2, 2]]


def test_a_learner_of_shards_trains_its_dpo_term_on_the_pairs(tmp_path):
    store = f"file://{tmp_path}"
    writer = ShardWriter(ObjectStore(store), "diloco", "gen0", compression="none")
    writer.write([rollout_record(_traj(0, 0, 1.0), 1), rollout_record(_traj(1, 0, 0.0), 1),
                  preference_record(_pair(7), 1)])
    learn, _, learner = _loop(store, "learn", **{"trainer.prompts_per_step": 1, "replay.beta": 0.5})
    assert [type(t).__name__ for t in learn.terms] == ["PolicyGradientTerm", "ShardPairsTerm"]  # no teachers of its own
    metrics, _ = learn.step()
    dpo = [call for call in learner.calls if call[0] == "fb" and call[2] == "dpo"]
    assert len(dpo) == 1 and [_sequence(d) for d in dpo[0][1]] == [[1, 2, 7, 57, 2], [1, 2, 7, 67, 2]]
    assert metrics["replay/dpo_items"] == 1 and "loss/replay_dpo" in metrics
    learn.close()


def test_record_to_trajectory_checks_its_lengths():
    record = rollout_record(_traj(0, 0, 1.0), 1)
    assert trajectory_from_record(record, "gen0").tokens == [10, 10, 10]
    with pytest.raises(ValueError, match="differ in length"):
        trajectory_from_record({**record, "mask": [1]}, "gen0")


def test_a_generation_job_follows_the_runs_newest_outer_state(tmp_path):
    store = f"file://{tmp_path}"
    common = {"diloco.enabled": "true", "diloco.replicas": 1, "diloco.inner_steps": 2}
    cfg = load_config(RunConfig, None, [f"diloco.{k}={v}" for k, v in
                                        {"enabled": "true", "store_url": store, "replicas": 1, "inner_steps": 2,
                                         "poll_interval_s": 0.02, "round_timeout_s": 30}.items()])
    trainer, _, trainer_learner = _loop(store, "train", DiLoCoFakeLearner(cfg.diloco), **common)
    follower_learner = DiLoCoFakeLearner(cfg.diloco)
    follower_learner.sync = ModelSync(cfg.diloco, follower_learner.layer, writer=False)
    gen, _, _ = _loop(store, "generate", follower_learner, **common)
    trainer.join()
    for _ in range(2):
        trainer.step()  # round 1
    gen.join()
    assert gen.hooks[0].round == 1
    metrics = [gen.step()[0] for _ in range(2)]
    assert metrics[1]["diloco/followed"] == 0 and "version" not in metrics[1]  # nothing new: no publish
    for _ in range(2):
        trainer.step()  # round 2
    metrics += [gen.step()[0] for _ in range(2)]
    assert metrics[3]["diloco/round"] == 2 and metrics[3]["diloco/followed"] == 1 and metrics[3]["version"] == 4
    for k, v in trainer_learner.published[4].items():  # the generators now sample with round 2's weights
        assert torch.equal(v, follower_learner.published[4][k])
    assert not [c for c in follower_learner.fake.calls if c[0] in ("fb", "opt")]
    trainer.close()
    gen.close()
    rounds = {s.manifest["step"]: {r["diloco_round"] for r in s.records}
              for s in ShardReader(ObjectStore(store), "diloco").shards() if s.producer == "gen0"}
    assert rounds == {1: {1}, 2: {1}, 3: {1}, 4: {1}}  # all sampled with round 1's weights (published at join)


def test_a_generation_job_waits_for_the_run_within_max_rounds_behind_then_fails_in_one_line(tmp_path):
    from meshrl.controller.diloco_link import DiLoCoFailed

    store = f"file://{tmp_path}"
    cfg = load_config(RunConfig, None, ["diloco.enabled=true", f"diloco.store_url={store}", "diloco.replicas=1"])
    ModelSync(cfg.diloco, torch.nn.Linear(4, 3)).join()  # the run's initial state (round 0), no learner progress
    follower = DiLoCoFakeLearner(cfg.diloco)
    follower.sync = ModelSync(cfg.diloco, follower.layer, writer=False)
    gen, _, _ = _loop(store, "generate", follower, **{"diloco.enabled": "true", "diloco.replicas": 1,
                                                      "diloco.inner_steps": 1, "diloco.max_rounds_behind": 1,
                                                      "diloco.round_timeout_s": 0.5})
    gen.join()
    assert gen.step()[0]["diloco/round"] == 0  # round 1 - 1 = 0 is there
    with pytest.raises(DiLoCoFailed, match=r"generation job 0: the run did not reach round 1 within 0s "
                                           r"\(diloco.round_timeout_s\) \(max_rounds_behind = 1\)"):
        gen.step()
    gen.close()


@pytest.mark.parametrize("config, overrides, message", [
    (None, ["diloco.role=generate"], "store_url is required"),
    (None, ["diloco.role=learn", "diloco.store_url=file:///tmp/x", "diloco.rollout_shards=true"], "write back the shards"),
    (None, ["diloco.role=learn", "diloco.store_url=file:///tmp/x", "sdpo.alpha=0.1"], "SDPO channel needs a job that"),
    ("configs/ablation-sdpo.yaml", ["diloco.role=generate", "diloco.store_url=file:///tmp/x"], "SDPO channel needs"),
])
def test_role_config_errors_are_one_line(config, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(RunConfig, config and str(ROOT / config), overrides)
