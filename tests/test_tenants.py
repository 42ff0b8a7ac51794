"""LoRA tenants on one base model (tiny model, CPU, no Monarch): adapters trained alternately equal
the same adapters trained alone (no optimiser state, gradient or step count leaks between them),
each publishes its own merged weights, and a saved adapter resumes bit-for-bit with its optimiser
(or starts a fresh one)."""

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


def _datums(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        toks = torch.randint(0, 49152, (8 + i,), generator=g).tolist()
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
        assert loaded == {"name": name, "rank": 4, "steps_applied": 2, "optimizer": True}
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
        (lambda: trainer.tenants.add("x", rank=2, train_unembed=True), "train_unembed=True is not supported"),
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
    assert PolicyTrainer(model_path, LearnerConfig(torch_threads=1)).tenants is None
