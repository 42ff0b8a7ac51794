"""Learner checkpoints: weights (or only the LoRA adapter), optimiser state and RNG states, so a
resumed learner continues bit-for-bit; and export of the policy as a plain HF model directory.

Weights and optimiser state are written with ``torch.distributed.checkpoint`` (DCP) under their
fully qualified names, each rank writing its own shard, so a checkpoint written by N data-parallel
learner processes (FSDP2 shards or DDP replicas) resumes with any other number of processes,
including one. Rank 0 also writes the RNG state and ``learner.json``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

STATE = "state"  # the DCP directory (model + optimizer)
RNG = "rng.pt"
META = "learner.json"


def _options(trainer, **kwargs) -> StateDictOptions:
    # under LoRA only the adapter is trained: frozen base weights come from the model files
    return StateDictOptions(ignore_frozen_params=trainer.cfg.lora.enabled, **kwargs)


def _training_state(trainer) -> tuple[dict, dict]:
    """Model and optimiser state dicts by fully qualified name (sharded under FSDP2). Under LoRA
    only trainable tensors: the frozen base (a tied head included) comes from the model files."""
    model_state, optim_state = get_state_dict(trainer.logits_module, trainer.optimizer, options=_options(trainer))
    if trainer.cfg.lora.enabled:
        trainable = {n for n, p in trainer.logits_module.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trainable}
    return model_state, optim_state


def save_learner(trainer, directory: Path) -> None:
    """Write the learner's full training state into ``directory`` (created if needed). Every
    data-parallel rank calls this together."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = _training_state(trainer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / STATE),
             no_dist=trainer.dp.world == 1)
    if trainer.dp.rank == 0:
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, directory / RNG)
        meta = {"lora": trainer.cfg.lora.enabled, "steps_applied": trainer.steps_applied,
                "world": trainer.dp.world, "data_parallel": trainer.dp.mode}
        (directory / META).write_text(json.dumps(meta))


def load_learner(trainer, directory: Path) -> dict:
    """Restore what `save_learner` wrote, whatever number of processes wrote it; errors name the
    file and what is wrong. Every data-parallel rank calls this together."""
    directory = Path(directory)
    for name in (STATE, RNG, META):
        if not (directory / name).exists():
            raise FileNotFoundError(f"learner checkpoint {directory}: missing {name}")
    meta = json.loads((directory / META).read_text())
    if meta["lora"] != trainer.cfg.lora.enabled:
        raise ValueError(f"learner checkpoint {directory}: lora={meta['lora']} but the config says "
                         f"learner.lora.enabled={trainer.cfg.lora.enabled}")
    model_state, optim_state = _training_state(trainer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(directory / STATE), no_dist=trainer.dp.world == 1)
    except Exception as e:  # DCP reports a missing or mismatched key over many lines
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"learner checkpoint {directory / STATE}: {first.strip()}") from None
    set_state_dict(trainer.logits_module, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options(trainer, strict=not trainer.cfg.lora.enabled))
    rng = torch.load(directory / RNG, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    trainer.steps_applied = meta["steps_applied"]
    return meta


def saved_names(directory: Path) -> list[str]:
    """Names of the model tensors a checkpoint holds (for inspection and tests)."""
    metadata = dcp.FileSystemReader(str(Path(directory) / STATE)).read_metadata()
    return sorted(k.removeprefix("model.model.") for k in metadata.state_dict_metadata if k.startswith("model."))


def export_hf(trainer, directory: Path) -> Path:
    """Save the policy as a standard HF model directory (float32, LoRA merged) with its tokenizer,
    streamed to disk a decoder layer at a time: one safetensors file per layer (and per other
    top-level tensor) plus the index, so no process ever holds the whole model. Every
    data-parallel rank calls this together; under FSDP2 each layer's shards are gathered on rank
    0, which writes."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    directory = Path(directory)
    if trainer.dp.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    groups = trainer.export_groups()
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        tensors = trainer.dp.gather_to_first(group())
        if trainer.dp.rank != 0:
            continue
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if trainer.dp.rank != 0:
        return directory
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model = trainer.model.get_base_model() if trainer.cfg.lora.enabled else trainer.model
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(trainer.model_path).save_pretrained(directory)
    return directory
