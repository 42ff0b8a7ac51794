"""LoRA: adapter-only weight sync merges to exactly the learner's merged weights, and a real run
with `lora.sync: adapter` moves only the adapter yet keeps generator and learner in agreement."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.lora import is_adapter, load_base_state, merge_adapter, write_peft_adapter
from meshrl.training.policy import PolicyTrainer
from meshrl.types import Datum


def _trained_lora_trainer():
    cfg = LearnerConfig(lr=5e-2, torch_threads=1, lora={"enabled": True, "rank": 4, "alpha": 16, "sync": "adapter"})
    trainer = PolicyTrainer(resolve_model("tiny"), cfg)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 49152, (10,), generator=g).tolist()
    datum = Datum.from_sequence(toks, mask=[0] * 4 + [1] * 6, logprobs=[-3.0] * 10, advantages=[0.0] * 4 + [1.0] * 6)
    trainer.forward_backward([datum], "importance_sampling")
    trainer.optim_step(cfg.adam_params())  # B moves away from its zero init
    return trainer


def test_merging_the_published_adapter_reproduces_the_merged_model():
    trainer = _trained_lora_trainer()
    adapter = {name: shard.load() for name, shard in trainer.sync_shards().items()}  # what the learner publishes
    assert is_adapter(adapter) and all("lora" in k for k in adapter)
    base = load_base_state(resolve_model("tiny"), dtype=torch.float32)
    merged = merge_adapter(base, adapter)
    expected = trainer.inference_state_dict(dtype=torch.float32)
    assert set(expected) <= set(merged)
    changed = 0
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
        changed += not torch.equal(tensor, base[name])
    assert changed > 0
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert adapter_bytes < 0.2 * sum(t.numel() * t.element_size() for t in expected.values())


def test_the_published_adapter_written_as_a_peft_directory_loads_as_the_same_model(tmp_path):
    """What an engine that applies adapters itself reads (`generator.lora_slots`): PEFT loads the
    directory onto the base model and merges to the learner's merged weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trained_lora_trainer()
    adapter = {name: shard.load() for name, shard in trainer.sync_shards().items()}
    assert write_peft_adapter(adapter, tmp_path / "v1", torch.float32) == (4, frozenset(trainer.cfg.lora.target_modules))
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, tmp_path / "v1").merge_and_unload().state_dict()
    expected = trainer.inference_state_dict(dtype=torch.float32)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-5)
    uneven = {**adapter, "model.layers.0.mlp.up_proj.lora_scaling": torch.tensor([9.0])}
    with pytest.raises(ValueError, match="differ in rank"):
        write_peft_adapter(uneven, tmp_path / "v2")


def test_merge_rejects_an_adapter_for_an_unknown_module():
    with pytest.raises(KeyError, match="no base weight"):
        merge_adapter({}, {"x.lora_A": torch.zeros(1, 1), "x.lora_B": torch.zeros(1, 1),
                           "x.lora_scaling": torch.ones(1)})


@pytest.mark.monarch
@pytest.mark.slow  # ~12 s on 2 cores
def test_adapter_only_sync_in_a_real_run(tiny_run_config, tiny_session):
    from meshrl.controller.runtime import Runtime

    cfg = tiny_run_config("learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.sync=adapter",
                          "learner.lr=5e-2")
    with Runtime(cfg, session=tiny_session) as rt:
        for _ in range(2):
            metrics, trajectories = rt.loop.step()
        assert metrics["version"] == 2
        assert 0 < metrics["sync/bytes"] < 2e6  # the tiny model itself is 13 MB
        sequences = [t.prompt_tokens + t.tokens for t in trajectories[:4]]
        gen = rt.meshes["generator"].slice(procs=0).score.call_one(sequences).get(timeout=120)
        learn = rt.meshes["learner"].forward.call_one([Datum.from_sequence(s) for s in sequences]).get(timeout=120)
        diffs = [abs(a - b) for ga, la in zip(gen, learn) for a, b in zip(ga, la)]
        assert sum(diffs) / len(diffs) < 0.02, sum(diffs) / len(diffs)
