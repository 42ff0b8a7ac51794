"""Learner checkpoints: weights (or only the LoRA adapter), optimiser state and RNG states, so a
resumed learner continues bit-for-bit; and export of the policy as a plain HF model directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
META = "learner.json"


def _trainable_state(trainer) -> dict[str, torch.Tensor]:
    """What must be saved to restore the model: all weights, or just the adapter under LoRA."""
    if trainer.cfg.lora.enabled:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(trainer.model)
    return trainer.model.state_dict()


def _unique_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): keep the first name of each storage."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def save_learner(trainer, directory: Path) -> None:
    """Write the learner's full training state into ``directory`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_unique_contiguous(_trainable_state(trainer)), str(directory / WEIGHTS))
    torch.save(trainer.optimizer.state_dict(), directory / OPTIMIZER)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, directory / RNG)
    meta = {"lora": trainer.cfg.lora.enabled, "steps_applied": trainer.steps_applied}
    (directory / META).write_text(json.dumps(meta))


def load_learner(trainer, directory: Path) -> dict:
    """Restore what `save_learner` wrote; errors name the file and what is wrong."""
    directory = Path(directory)
    for name in (WEIGHTS, OPTIMIZER, RNG, META):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"learner checkpoint {directory}: missing {name}")
    meta = json.loads((directory / META).read_text())
    if meta["lora"] != trainer.cfg.lora.enabled:
        raise ValueError(f"learner checkpoint {directory}: lora={meta['lora']} but the config says "
                         f"learner.lora.enabled={trainer.cfg.lora.enabled}")
    weights = load_file(str(directory / WEIGHTS))
    if trainer.cfg.lora.enabled:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(trainer.model, weights)
    else:
        missing, unexpected = trainer.model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k not in _tied_names(trainer.model)]
        if missing or unexpected:
            raise ValueError(f"learner checkpoint {directory}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    trainer.optimizer.load_state_dict(torch.load(directory / OPTIMIZER, weights_only=False))
    rng = torch.load(directory / RNG, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    trainer.steps_applied = meta["steps_applied"]
    return meta


def _tied_names(model) -> set[str]:
    """Names that alias another parameter's storage (e.g. lm_head.weight with tied embeddings)."""
    state = model.state_dict()
    kept = _unique_contiguous(state)
    return set(state) - set(kept)


def export_hf(trainer, directory: Path) -> Path:
    """Save the policy as a standard HF model directory (LoRA merged) with its tokenizer."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = trainer.model
    if trainer.cfg.lora.enabled:
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(trainer.model_path).save_pretrained(directory)
    return directory
