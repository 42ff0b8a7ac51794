"""LoRA adapter sync: the learner publishes only the adapter matrices; each reader merges them into
the base weights it holds (W = W0 + scale * B @ A) and loads the merged model. What crosses the
wire is the adapter (a few MB), not the model."""

from __future__ import annotations

from pathlib import Path

import torch

SCALING_SUFFIX = ".lora_scaling"


def adapter_state_dict(peft_model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{base_module.lora_A, base_module.lora_B, base_module.lora_scaling}`` for every adapted
    module, keyed by the module's name in the base HF model."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        base = name.removeprefix("base_model.model.")
        out[f"{base}.lora_A"] = module.lora_A["default"].weight.detach().to(dtype).contiguous()
        out[f"{base}.lora_B"] = module.lora_B["default"].weight.detach().to(dtype).contiguous()
        out[f"{base}{SCALING_SUFFIX}"] = torch.tensor([float(module.scaling["default"])], dtype=dtype)
    return out


def is_adapter(tensors: dict[str, torch.Tensor]) -> bool:
    return any(k.endswith(".lora_A") for k in tensors)


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
