"""LoRA tenants on one base model (tiny model, CPU): adapters trained alternately equal the same
adapters trained alone (no optimiser state, gradient or step count leaks between them), each
publishes its own merged weights, and a saved adapter resumes bit-for-bit with its optimiser (or
starts a fresh one). With real Monarch processes: generators of both engines load exact versions
published by different adapters, older and newer, and score (prompt logprobs) like the learner."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.testing.custom_losses import importance_sampling_custom
from meshrl.training.lora import adapter_state_dict, load_base_state, merge_adapter
from meshrl.training.policy import PolicyTrainer
from meshrl.types import AdamParams, Datum

ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _trainer(model_path, rank=4, **kwargs):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, autocast_bf16=False, lora={"enabled": True, "rank": rank},
                        **kwargs)
    return PolicyTrainer(model_path, cfg)


def _sequences(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (8 + i,), generator=g).tolist() for i in range(n)]


def _datums(seed, n=3):
    out = []
    for i, toks in enumerate(_sequences(seed, n)):
        k = len(toks) - 4
        out.append(Datum.from_sequence(toks, mask=[0] * k + [1] * 4, logprobs=[0.0] * k + [-11.0] * 4,
                                       advantages=[0.0] * k + [0.5 * (i - 1)] * 4))
    return out


ALICE = dict(rank=4, seed=1)
BOB = dict(rank=8, seed=2, train_mlp=False)


def _step(trainer, step, data_seed, custom=False):
    """One optimiser step of the active adapter on its data: two forward_backward calls."""
    datums = _datums(data_seed + step)
    trainer.forward_backward(datums[:2], "importance_sampling")
    if custom:
        trainer.forward_backward_custom(datums[2:], importance_sampling_custom)
    else:
        trainer.forward_backward(datums[2:], "importance_sampling")
    trainer.scale_grads(0.5)
    return trainer.optim_step(ADAM)


def _adapter(trainer, name):
    return {k: v.clone() for k, v in adapter_state_dict(trainer.model, adapter=name).items()}


def _assert_close(a, b, atol=1e-6):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def _adam_state(trainer, name):
    state = trainer.tenants.states[name].optimizer.state_dict()["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}


def test_tenants_trained_alternately_equal_each_trained_alone(model_path):
    shared = _trainer(model_path)
    default_before = _adapter(shared, "default")
    assert shared.tenants.add("alice", **ALICE)["seed"] == 1
    shared.tenants.add("bob", **BOB)
    for step in range(3):
        # alice's first pass, then all of bob's step, then the rest of alice's step: alice's
        # pending gradients wait on her own parameters meanwhile
        shared.tenants.use("alice")
        datums = _datums(100 + step)
        shared.forward_backward(datums[:2], "importance_sampling")
        shared.tenants.use("bob")
        _step(shared, step, 200, custom=True)
        shared.tenants.use("alice")
        shared.forward_backward(datums[2:], "importance_sampling")
        shared.scale_grads(0.5)
        shared.optim_step(ADAM)

    for name, options, data_seed, custom in (("alice", ALICE, 100, False), ("bob", BOB, 200, True)):
        alone = _trainer(model_path)
        alone.tenants.add(name, **options)
        alone.tenants.use(name)
        for step in range(3):
            _step(alone, step, data_seed, custom)
        _assert_close(_adapter(shared, name), _adapter(alone, name))
        _assert_close(_adam_state(shared, name), _adam_state(alone, name))
        assert shared.tenants.states[name].steps_applied == alone.steps_applied == 3
    _assert_close(_adapter(shared, "default"), default_before, atol=0)
    assert shared.tenants.states["default"].steps_applied == 0 and not _adam_state(shared, "default")
    assert {k.split(".")[-2] for k in _adapter(shared, "bob") if k.endswith("lora_A")} == {"q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"}


def test_each_adapter_publishes_its_own_merged_weights(model_path):
    trainer = _trainer(model_path)
    trainer.tenants.add("alice", **ALICE)
    trainer.tenants.add("bob", **BOB)
    for name, seed in (("alice", 100), ("bob", 200)):
        trainer.tenants.use(name)
        _step(trainer, 0, seed)
    base = load_base_state(model_path, dtype=torch.float32)
    merged = {}
    for name in ("alice", "bob", "default"):
        trainer.tenants.use(name)
        merged[name] = trainer.inference_state_dict(dtype=torch.float32)
        from_adapter = merge_adapter(base, _adapter(trainer, name))  # what `lora.sync: adapter` readers build
        _assert_close({k: from_adapter[k] for k in merged[name]}, merged[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged["alice"][q], merged["bob"][q])
    assert torch.equal(merged["default"][q], base[q])  # B starts at zero: untrained adapters change nothing
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(merged["bob"][gate], base[gate]) and not torch.equal(merged["alice"][gate], base[gate])


def test_save_and_load_resume_an_adapter_with_or_without_its_optimiser(model_path, tmp_path):
    trainer = _trainer(model_path)
    trainer.tenants.add("alice", **ALICE)
    trainer.tenants.use("alice")
    for step in range(2):
        _step(trainer, step, 100)
    saved = trainer.tenants.save("alice", tmp_path / "alice")
    assert saved == {"path": str(tmp_path / "alice"), "steps_applied": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice"]  # no temporary directory left
    after_two = _adapter(trainer, "alice")
    _step(trainer, 2, 100)
    expected = _adapter(trainer, "alice")

    # into the active (and only) adapter of another rank, a new name, an inactive adapter of another rank
    solo, other = _trainer(model_path, rank=2), _trainer(model_path, rank=2)
    other.tenants.add("carol", rank=2, seed=5)
    for target, name in ((solo, "default"), (other, "alice"), (other, "carol")):
        active = target.tenants.active
        loaded = target.tenants.load(name, tmp_path / "alice", with_optimizer=True)
        assert loaded == {"name": name, "rank": 4, "steps_applied": 2, "optimizer": True, "optimizer_type": "adamw"}
        assert target.tenants.active == active
        target.tenants.use(name)
        _assert_close(_adapter(target, name), after_two, atol=0)
        _step(target, 2, 100)
        assert target.steps_applied == 3
        _assert_close(_adapter(target, name), expected)

    other.tenants.use("alice")
    _step(other, 3, 100)  # pending state of the adapter about to be overwritten
    other.forward_backward(_datums(7), "importance_sampling")
    assert other.tenants.load("alice", tmp_path / "alice", with_optimizer=False)["steps_applied"] == 0
    assert other.steps_applied == 0 and not other.optimizer.state
    assert all(p.grad is None for p in other.tenants.parameters("alice"))
    _assert_close(_adapter(other, "alice"), after_two, atol=0)
    _step(other, 2, 100)
    fresh_step = _adapter(other, "alice")
    assert max((fresh_step[k] - expected[k]).abs().max() for k in expected) > 1e-4  # Adam restarted

    trainer.tenants.save("alice", tmp_path / "alice")  # replaces the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice"]
    assert other.tenants.load("alice", tmp_path / "alice", with_optimizer=True)["steps_applied"] == 3


def test_tenant_errors_are_one_line(model_path, tmp_path):
    trainer = _trainer(model_path)
    trainer.tenants.add("alice", rank=2)
    cases = [
        (lambda: trainer.tenants.add("alice", rank=2), "LoRA adapter 'alice' already exists"),
        (lambda: trainer.tenants.add("a.b", rank=2), "LoRA adapter name 'a.b': use letters"),
        (lambda: trainer.tenants.add("x", rank=2, train_unembed=True), "train_unembed=True needs an untied"),
        (lambda: trainer.tenants.add("x", rank=2, train_mlp=False, train_attn=False), "nothing to train"),
        (lambda: trainer.tenants.use("nobody"), r"no LoRA adapter 'nobody' \(have \['alice', 'default'\]\)"),
        (lambda: trainer.tenants.remove("default"), "'default' is the active adapter"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(FileNotFoundError, match="missing adapter_model.safetensors"):
        trainer.tenants.load("alice", tmp_path, with_optimizer=False)
    trainer.tenants.remove("alice")
    assert sorted(trainer.tenants.states) == ["default"] and "alice" not in trainer.model.peft_config
    trainer.dp.world = 2  # as in a data-parallel learner
    with pytest.raises(ValueError, match=r"^LoRA tenants need one learner process \(.*procs = 1\), not 2$"):
        trainer.tenants.use("default")
    assert PolicyTrainer(model_path, LearnerConfig(torch_threads=1)).tenants is None


@pytest.mark.monarch
@pytest.mark.slow
def test_samplers_load_the_exact_version_of_each_adapter():
    """A learner publishes alice v1, bob v2, alice v3 (adapter sync); generators of both engines load
    v2, v3, then v1 exactly and score like the learner's adapter did when it published them."""
    from monarch.actor import this_host

    from meshrl.actors.generator import Generator
    from meshrl.actors.learner import Learner
    from meshrl.transport.weight_store import weight_index
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from tests.conftest import TINY_RUN

    cfg = load_config(RunConfig, None, TINY_RUN + [
        "learner.lora.enabled=true", "learner.lora.sync=adapter", "weight_sync.keep_versions=3",
        "weight_sync.max_arenas=4", "learner.torch_threads=1", "generator.torch_threads=1"])
    path = str(resolve_model("tiny"))
    weight_index().get(timeout=30)
    procs = {role: this_host().spawn_procs(per_host={"procs": 1}) for role in ("learner", "vllm", "hf")}
    try:
        learner = procs["learner"].spawn("learner", Learner, path, cfg.model, cfg.learner, cfg.weight_sync,
                                         "tenants")
        generators = [procs[b].spawn("generator", Generator, path, cfg.model,
                                     cfg.generator.model_copy(update={"backend": b}), cfg.weight_sync, "tenants")
                      for b in ("vllm", "hf")]
        sequences = [s for seed in (1, 2, 3) for s in _sequences(seed)]  # the data of each version
        expected = {}
        for version, (name, options) in enumerate((("alice", ALICE), ("bob", BOB), ("alice", None)), start=1):
            if options:
                learner.add_adapter.call_one(name, **options).get(timeout=60)
            learner.use_adapter.call_one(name).get(timeout=60)
            learner.forward_backward.call_one(_datums(version), "importance_sampling").get(timeout=60)
            learner.optim_step.call_one(AdamParams(learning_rate=5e-2)).get(timeout=60)
            assert 0 < learner.publish.call_one(version).get(timeout=60)["bytes"] < 2e6  # the adapter only
            expected[version] = learner.forward.call_one([Datum.from_sequence(s) for s in sequences]).get(timeout=60)
        for generator in generators:
            for version in (2, 3, 1):
                loaded = generator.load_version.call_one(version).get(timeout=120)
                assert loaded["version"] == version and loaded["bytes"] > 0
                scores = generator.score.call_one(sequences).get(timeout=120)
                assert [len(s) for s in scores] == [len(s) - 1 for s in sequences]  # token i given tokens < i, i >= 1
                gaps = {v: _mean_gap(scores, lp) for v, lp in expected.items()}
                assert gaps[version] < 0.02 and min(gaps, key=gaps.get) == version, gaps
            assert generator.load_version.call_one(1).get(timeout=60)["bytes"] == 0  # held: nothing moves
    finally:
        for pm in procs.values():
            pm.stop().get(timeout=30)


def _mean_gap(a, b):
    diffs = [abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return sum(diffs) / len(diffs)
