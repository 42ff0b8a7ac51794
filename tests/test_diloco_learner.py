"""The learner's side of DiLoCo without Monarch: PolicyTrainers on the tiny model as replicas of one
run over a file:// store (join aligns them, a round applies the outer Nesterov step to the average
pseudo-gradient, a data-parallel follower applies the same round without uploading, LoRA syncs only
the adapter, a resumed checkpoint keeps its weights only while the run is still in its round), and
the GRPO loop's schedule over fake meshes (a round every `inner_steps` steps before publishing, its
report in the metrics, one rollout shard per step)."""

import threading

import pytest
import torch

from meshrl.config.diloco import DiLoCoConfig
from meshrl.config.learner import LearnerConfig
from meshrl.diloco.replica import ModelSync
from meshrl.diloco.shards import ShardReader
from meshrl.diloco.store import ObjectStore
from meshrl.models.provision import resolve_model
from meshrl.training.checkpoint import load_learner, save_learner
from meshrl.training.policy import PolicyTrainer
from meshrl.testing.datums import random_datums


def _step(trainer, seed):
    trainer.forward_backward(random_datums(seed), "ppo")
    trainer.optim_step(trainer.cfg.adam_params())


def _weights(trainer):
    return {k: p.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}


def _in_threads(*fns, timeout=120):
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    if errors:
        raise errors[0]
    return out


def _cfg(store, replica, replicas=2):
    return DiLoCoConfig(enabled=True, store_url=store, replicas=replicas, replica_id=replica, poll_interval_s=0.02,
                        round_timeout_s=60, op_timeout_s=30)


@pytest.mark.slow  # ~12 s on 2 cores
def test_tiny_policy_replicas_sync_follow_and_resume(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    lcfg = LearnerConfig(lr=1e-3, torch_threads=1)
    path = resolve_model("tiny")
    a, b, follower = (PolicyTrainer(path, lcfg) for _ in range(3))
    with torch.no_grad():  # replica 1 starts elsewhere: joining the run must bring it to replica 0's weights
        for p in b.model.parameters():
            p.add_(0.01)
    sa, sb = ModelSync(_cfg(store, 0), a.model), ModelSync(_cfg(store, 1), b.model)
    sf = ModelSync(_cfg(store, 0), follower.model, writer=False)  # replica 0's second data-parallel rank
    assert sa.join() == {"round": 0, "hash": sa.sync.base_hash, "rejoined": False, "kept_checkpoint_weights": 0}
    assert sb.join()["rejoined"] and sf.join()["round"] == 0
    start = _weights(a)
    assert all(torch.equal(start[k], v) for k, v in _weights(b).items())

    # one inner step each (the follower sees replica 0's data, as a data-parallel rank holds the same weights)
    for trainer, seed in ((a, 1), (b, 2), (follower, 1)):
        _step(trainer, seed)
    local_a, local_b = _weights(a), _weights(b)
    ra, rb, rf = _in_threads(sa.step, sb.step, sf.step)
    assert ra["round"] == rb["round"] == 1 and ra["participants"] == rb["participants"] == [0, 1]
    assert ra["hash"] == rb["hash"] == rf["hash"] and ra["bytes_up"] > 0 and ra["included"] == 1
    after = _weights(a)
    for k, v in after.items():
        assert torch.equal(v, _weights(b)[k]) and torch.equal(v, _weights(follower)[k]), k
        # the first Nesterov outer step: theta - lr * (1 + momentum) * mean(delta)
        mean_delta = ((start[k] - local_a[k]) + (start[k] - local_b[k])) / 2
        torch.testing.assert_close(v, start[k] - 0.7 * 1.9 * mean_delta, rtol=0, atol=1e-6)
    commits = ObjectStore(store).list("diloco/rounds/000001")
    assert sorted(n for n in commits if n.startswith("commit-")) == ["commit-0000.json", "commit-0001.json"]

    # a checkpoint in the middle of round 2 ...
    _step(a, 3)
    save_learner(a, tmp_path / "ckpt")
    sa.save(tmp_path / "ckpt")
    checkpointed = _weights(a)
    # ... resumed while the run is still in round 2: the checkpoint's inner step still counts
    c = PolicyTrainer(path, lcfg)
    sc = ModelSync(_cfg(store, 0), c.model)
    load_learner(c, tmp_path / "ckpt")
    sc.load(tmp_path / "ckpt")
    assert sc.join() == {"round": 1, "hash": ra["hash"], "rejoined": True, "kept_checkpoint_weights": 1}
    assert all(torch.equal(checkpointed[k], v) for k, v in _weights(c).items())
    assert sc.sync.base_hash == sa.sync.base_hash  # the next round starts from the run's weights

    # round 2 ends without it (replica 0's first process finishes the round) ...
    _step(b, 4)
    _in_threads(sa.step, sb.step)
    # ... so the same checkpoint resumed now continues from round 2's outer state
    d = PolicyTrainer(path, lcfg)
    sd = ModelSync(_cfg(store, 0), d.model)
    load_learner(d, tmp_path / "ckpt")
    sd.load(tmp_path / "ckpt")
    report = sd.join()
    assert report["round"] == 2 and report["kept_checkpoint_weights"] == 0
    assert all(torch.equal(_weights(a)[k], v) for k, v in _weights(d).items())


def test_lora_replica_syncs_only_the_adapter(tmp_path):
    lcfg = LearnerConfig(lr=1e-2, torch_threads=1, lora={"enabled": True, "rank": 4, "alpha": 8})
    trainer = PolicyTrainer(resolve_model("tiny"), lcfg)
    sync = ModelSync(_cfg(f"file://{tmp_path}", 0, replicas=1), trainer.model)
    assert sync.params and all("lora_" in k for k in sync.params)
    frozen = {k: p.detach().clone() for k, p in trainer.model.named_parameters() if not p.requires_grad}
    sync.join()
    before = _weights(trainer)
    _step(trainer, 0)
    report = sync.step()
    assert report["round"] == 1 and report["participants"] == [0]
    assert any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())
    assert all(torch.equal(frozen[k], p) for k, p in trainer.model.named_parameters() if not p.requires_grad)


class DiLoCoFakeLearner:
    """The fake learner of meshrl.testing.fake_meshes with real weights: a linear layer each
    optimizer step moves by a replica-specific amount, synced by a real ModelSync."""

    def __init__(self, cfg: DiLoCoConfig):
        from meshrl.testing.fake_meshes import FakeLearner

        self.fake = FakeLearner()
        self.layer = torch.nn.Linear(4, 3)
        self.replica = cfg.replica_id
        self.sync = ModelSync(cfg, self.layer)
        self.published = {}

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def optim_step(self, adam):
        with torch.no_grad():
            for p in self.layer.parameters():
                p.add_(0.01 * (self.replica + 1))
        return self.fake.optim_step(adam)

    def publish(self, version):
        self.published[version] = {k: v.clone() for k, v in self.layer.state_dict().items()}
        return self.fake.publish(version)

    def diloco_join(self):
        return self.sync.join()

    def diloco_sync(self):
        return self.sync.step()


def test_grpo_loops_sync_every_inner_steps_before_publishing_and_write_shards(tmp_path):
    from meshrl.testing.fake_meshes import make_loop

    store = f"file://{tmp_path}"
    loops = []
    for replica in (0, 1):
        overrides = {"trainer.prompts_per_step": 2, "trainer.group_size": 2, "diloco.enabled": "true",
                     "diloco.store_url": store, "diloco.replica_id": replica, "diloco.inner_steps": 2,
                     "diloco.poll_interval_s": 0.02, "diloco.round_timeout_s": 60, "diloco.rollout_shards": "true"}
        from meshrl.config.base import load_config
        from meshrl.config.run import RunConfig

        cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])
        loops.append(make_loop(learner=DiLoCoFakeLearner(cfg.diloco), **overrides))
    for loop, _, _ in loops:
        loop.join()
        assert loop.hooks[0].round == 0

    def run(loop):
        return [loop.step()[0] for _ in range(4)]

    metrics = _in_threads(*[lambda loop=loop: run(loop) for loop, _, _ in loops])
    for m in metrics:
        assert ["diloco/round" in s for s in m] == [False, True, False, True]
        assert [m[1]["diloco/round"], m[3]["diloco/round"]] == [1, 2]
        assert all(s["diloco/participants"] == 2 and s["diloco/wait_s"] >= 0 and s["diloco/bytes_up"] > 0
                   for s in (m[1], m[3]))
        assert [s["shards/index"] for s in m] == [0, 1, 2, 3]
    assert [s["diloco/hash"] for s in metrics[0] if "diloco/hash" in s] == \
        [s["diloco/hash"] for s in metrics[1] if "diloco/hash" in s]
    # the versions published at the end of a round carry the same outer-updated weights
    l0, l1 = loops[0][2], loops[1][2]
    for version in (2, 4):
        for k, v in l0.published[version].items():
            assert torch.equal(v, l1.published[version][k])
    assert not torch.equal(l0.published[3]["weight"], l1.published[3]["weight"])  # inner steps differ
    for loop, _, _ in loops:
        loop.close()

    reader = ShardReader(ObjectStore(store), "diloco")
    shards = list(reader.shards())
    assert [(s.producer, s.manifest["step"]) for s in shards] == [
        (f"replica{r}", step) for r in (0, 1) for step in (1, 2, 3, 4)]
    assert reader.rejected == 0
    for s in shards:
        assert s.manifest["count"] == len(s.records) == 4  # 2 groups of 2
        assert {r["group"] for r in s.records} == {0, 1}
        assert all(isinstance(t, int) for r in s.records for t in r["prompt_tokens"] + r["tokens"])
        assert all(r["version"] == s.manifest["step"] - 1 for r in s.records)  # synchronous: sampled by the last version


def test_diloco_with_fsdp2_is_a_one_line_config_error():
    from meshrl.config.base import ConfigError, load_config
    from meshrl.config.run import RunConfig

    with pytest.raises(ConfigError, match="diloco.enabled with learner.data_parallel = 'fsdp2'"):
        load_config(RunConfig, None, ["diloco.enabled=true", "diloco.store_url=file:///tmp/x",
                                      "meshes.learner.procs=2", "learner.data_parallel=fsdp2"])
    with pytest.raises(ConfigError, match="store_url is required"):
        load_config(RunConfig, None, ["diloco.rollout_shards=true"])


def test_a_replica_restarted_after_its_delta_was_sealed_ends_the_round_like_the_others(tmp_path):
    """Replica 0 (the round's leader) dies after round 1 was sealed with its delta but before it
    published the round's outer state; restarted from the run's initial state with other inner
    steps, it ends round 1 with the sealed average (no new upload replaces its sealed delta), the
    same weights as replica 1, and publishes the missing outer state."""
    import shutil

    store = f"file://{tmp_path}"
    layers = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    syncs = [ModelSync(_cfg(store, i), layer) for i, layer in enumerate(layers)]
    for s in syncs:
        s.join()
    for layer, shift in zip(layers, (0.1, -0.3)):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(shift)
    reports = _in_threads(*[s.step for s in syncs])
    shutil.rmtree(tmp_path / "diloco" / "outer" / "000001")  # the leader died before publishing it

    restarted = torch.nn.Linear(3, 2)
    again = ModelSync(_cfg(store, 0), restarted)
    assert again.join()["round"] == 0
    with torch.no_grad():
        for p in restarted.parameters():
            p.add_(0.5)
    report = again.step()
    assert report["round"] == 1 and report["hash"] == reports[1]["hash"] and report["skipped"] == 0
    assert report["bytes_up"] == 0
    for k, p in restarted.named_parameters():
        assert torch.equal(p, dict(layers[1].named_parameters())[k])
    assert ObjectStore(store).list("diloco/outer") == ["000000", "000001"]
