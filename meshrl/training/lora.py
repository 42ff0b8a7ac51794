"""LoRA adapter sync: the learner publishes only the adapter matrices; each reader merges them into
the base weights it holds (W = W0 + scale * B @ A) and loads the merged model, or (an engine that
applies adapters itself: vLLM multi-LoRA) writes it out as a PEFT adapter directory. What crosses
the wire is the adapter (a few MB), not the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

SCALING_SUFFIX = ".lora_scaling"


def adapter_state_dict(peft_model, dtype: torch.dtype = torch.float32, adapter: str | None = None
                       ) -> dict[str, torch.Tensor]:
    """``{base_module.lora_A, base_module.lora_B, base_module.lora_scaling}`` for every module
    adapted by ``adapter`` (default: the active adapter), keyed by the module's name in the base HF
    model."""
    from peft.tuners.lora import LoraLayer

    adapter = adapter or peft_model.active_adapter
    out: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        base = name.removeprefix("base_model.model.")
        out[f"{base}.lora_A"] = module.lora_A[adapter].weight.detach().to(dtype).contiguous()
        out[f"{base}.lora_B"] = module.lora_B[adapter].weight.detach().to(dtype).contiguous()
        out[f"{base}{SCALING_SUFFIX}"] = torch.tensor([float(module.scaling[adapter])], dtype=dtype)
    return out


@torch.no_grad()
def merged_state_dict(peft_model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's HF-named weights with the active adapter merged (W0 + scale * B @ A in
    float32), computed out of place: merging into the model and back would leave rounding error in
    the base weights. Names that share one tensor (a tied head) keep sharing one result."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    deltas = {f"{name.removeprefix('base_model.model.')}.base_layer.weight": module.get_delta_weight(adapter)
              for name, module in peft_model.named_modules()
              if isinstance(module, LoraLayer) and adapter in module.lora_A}
    converted: dict[int, torch.Tensor] = {}
    state = {}
    for key, tensor in peft_model.get_base_model().state_dict().items():
        if "lora_" in key:
            continue
        if key in deltas:
            state[key.replace(".base_layer", "")] = (tensor + deltas[key]).to(dtype)
        else:
            state[key.replace(".base_layer", "")] = converted.setdefault(id(tensor), tensor.to(dtype, copy=True))
    return state


def unembedding_is_tied(model_path: Path) -> bool:
    """Whether the HF model at ``model_path`` ties its unembedding (``lm_head``) to its input
    embedding (`tie_word_embeddings`), so that a LoRA cannot adapt one without the other."""
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(str(model_path)).tie_word_embeddings)


def is_adapter(names: Iterable[str]) -> bool:
    """Whether tensors of these names (a state dict's keys) are a LoRA adapter's."""
    return any(k.endswith(".lora_A") for k in names)


def merge_adapter(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full state dict: ``base`` with every adapted ``<module>.weight`` replaced by
    W0 + scale * B @ A (computed in float32, returned in the base dtype)."""
    merged = dict(base)
    for key in adapter:
        if not key.endswith(".lora_A"):
            continue
        module = key[: -len(".lora_A")]
        weight_key = f"{module}.weight"
        if weight_key not in base:
            raise KeyError(f"adapter for '{module}' has no base weight '{weight_key}'")
        a = adapter[key].float()
        b = adapter[f"{module}.lora_B"].float()
        scale = float(adapter[f"{module}{SCALING_SUFFIX}"].item())
        w0 = base[weight_key]
        merged[weight_key] = (w0.float() + scale * (b @ a)).to(w0.dtype)
    return merged


def load_base_state(model_path: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base checkpoint's tensors (what adapters are merged into), tied lm_head included."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_path).glob("*.safetensors")):
        state.update({k: v.to(dtype) for k, v in load_file(str(shard)).items()})
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def write_peft_adapter(adapter: dict[str, torch.Tensor], directory: Path,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[int, frozenset[str]]:
    """Write an adapter (as `adapter_state_dict` gives it) as a PEFT adapter directory
    (`adapter_config.json`, `adapter_model.safetensors`) that PEFT and vLLM load; its rank and the
    kinds of module it adapts (`q_proj`, ...: its config's `target_modules`). Every
    module must share one rank and one scale (one `LoraConfig` made them); ``lora_alpha`` is
    written as scale * rank, which gives that scale back."""
    from safetensors.torch import save_file

    modules = sorted(k.removesuffix(".lora_A") for k in adapter if k.endswith(".lora_A"))
    if not modules:
        raise ValueError("the adapter has no lora_A matrices")
    ranks = {adapter[f"{m}.lora_A"].shape[0] for m in modules}
    scales = {round(float(adapter[f"{m}{SCALING_SUFFIX}"].item()), 6) for m in modules}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"the adapter's modules differ in rank {sorted(ranks)} or scale {sorted(scales)}")
    (rank,), (scale,) = ranks, scales
    tensors = {}
    for m in modules:
        for part in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{m}.{part}.weight"] = adapter[f"{m}.{part}"].to(dtype).contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    kinds = frozenset(m.rsplit(".", 1)[-1] for m in modules)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "fan_in_fan_out": False,
              "target_modules": sorted(kinds), "modules_to_save": None}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return rank, kinds
