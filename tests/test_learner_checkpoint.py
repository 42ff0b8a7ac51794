"""Learner checkpoints restore the exact training state (tiny model, CPU, no Monarch)."""

import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.checkpoint import export_hf, load_learner, save_learner, saved_names
from meshrl.training.policy import PolicyTrainer
from meshrl.testing.datums import random_datums


def _step(trainer, cfg, seed):
    metrics = trainer.forward_backward(random_datums(seed), "ppo")
    trainer.optim_step(cfg.adam_params())
    return metrics["loss"]


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path):
    cfg = LearnerConfig(lr=1e-3, torch_threads=1)
    path = resolve_model("tiny")
    a = PolicyTrainer(path, cfg)
    _step(a, cfg, 0)
    save_learner(a, tmp_path)
    continued = [_step(a, cfg, s) for s in (1, 2)]
    final = _weights(a)

    b = PolicyTrainer(path, cfg)  # fresh weights and optimiser: must be fully overwritten
    meta = load_learner(b, tmp_path)
    assert meta["steps_applied"] == 1
    resumed = [_step(b, cfg, s) for s in (1, 2)]
    assert resumed == continued
    for name, tensor in _weights(b).items():
        assert torch.equal(tensor, final[name]), name


def test_lora_checkpoint_holds_only_the_adapter_and_export_merges(tmp_path):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, lora={"enabled": True, "rank": 4, "alpha": 8})
    path = resolve_model("tiny")
    a = PolicyTrainer(path, cfg)
    _step(a, cfg, 0)
    save_learner(a, tmp_path / "ckpt")
    saved = saved_names(tmp_path / "ckpt")
    assert saved and all("lora_" in k for k in saved)

    b = PolicyTrainer(path, cfg)
    load_learner(b, tmp_path / "ckpt")
    assert [_step(b, cfg, 5)] == [_step(a, cfg, 5)]

    out = export_hf(a, tmp_path / "export")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    merged = a.inference_state_dict(dtype=torch.float32)
    assert not any("lora" in k for k in exported.state_dict())
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6)
