"""LoRA tenants: several LoRA adapters trained on one base model in one learner (peft multi-adapter),
each with its own AdamW state and step count.

One adapter is active at a time: PolicyTrainer's forward / backward passes, `scale_grads`,
`optim_step`, `inference_state_dict` (merged weights) and adapter sync act on it alone. Gradients
accumulated on an adapter live on its own parameters, so they stay with it across switches until
its next `optim_step`. The adapter built at start from `learner.lora` is named ``default``.

A saved adapter is a directory: a PEFT adapter (``adapter_model.safetensors`` and
``adapter_config.json``, loadable by ``peft.PeftModel.from_pretrained``), its AdamW state
(``optimizer.pt``) and ``tenant.json`` (``steps_applied``). It is written into a temporary sibling
directory and renamed into place, so a reader never sees a partial one.

Tenants need a single learner process: with data-parallel learners the calls raise.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT = "default"
"""The adapter built at start from `learner.lora`."""
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
WEIGHTS, CONFIG, OPTIMIZER, META = "adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "tenant.json"
_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class TrainState:
    """An optimiser and the steps it has applied: the policy's, or one LoRA adapter's."""

    optimizer: torch.optim.Optimizer
    steps_applied: int = 0


class LoraTenants:
    """The LoRA adapters of one PolicyTrainer and their TrainStates; switching adapters points the
    trainer's ``state`` at the active adapter's."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.states: dict[str, TrainState] = {DEFAULT: trainer.state}
        self._created = 1  # adapters built so far: the seed of one added without a seed

    @property
    def model(self):
        return self.trainer.model

    @property
    def active(self) -> str:
        return self.model.active_adapter

    def add(self, name: str, rank: int, alpha: float | None = None, seed: int | None = None, train_mlp: bool = True,
            train_attn: bool = True, train_unembed: bool = False) -> dict:
        """A new adapter (inactive, fresh AdamW state) initialised from ``seed`` (default: the
        learner seed plus the number of adapters built before it)."""
        self._check(name, exists=False)
        if train_unembed:
            raise ValueError("add_adapter: train_unembed=True is not supported (peft would merge a LoRA on lm_head "
                             "into the embedding it is tied to)")
        targets = (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
        if not targets:
            raise ValueError(f"add_adapter {name!r}: train_attn and train_mlp are both false: nothing to train")
        if rank < 1:
            raise ValueError(f"add_adapter {name!r}: rank must be >= 1, got {rank}")
        from peft import LoraConfig

        lora = self.trainer.cfg.lora
        config = LoraConfig(r=rank, lora_alpha=lora.alpha if alpha is None else alpha, lora_dropout=lora.dropout,
                            target_modules=list(targets), bias="none")
        seed = self._build(name, config, seed, self.active)
        return {"name": name, "seed": seed, "params": sum(p.numel() for p in self.parameters(name))}

    def use(self, name: str) -> dict:
        """Make ``name`` the active, trainable adapter (the others frozen) and its TrainState the trainer's."""
        self._check(name)
        self.model.set_adapter(name)
        self.trainer.state = self.states[name]
        return {"name": name, "steps_applied": self.trainer.state.steps_applied}

    def remove(self, name: str) -> None:
        """Delete an inactive adapter with its optimiser state."""
        self._check(name)
        if name == self.active:
            raise ValueError(f"remove_adapter: {name!r} is the active adapter: use_adapter another one first")
        self.model.delete_adapter(name)
        del self.states[name]

    def save(self, name: str, directory: Path) -> dict:
        """Write the adapter's weights, LoRA config, AdamW state and step count into ``directory``
        (replaced if it exists)."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        self._check(name)
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            weights = get_peft_model_state_dict(self.model, adapter_name=name)
            save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS))
            self.model.peft_config[name].save_pretrained(str(tmp))
            state = self.states[name]
            torch.save(state.optimizer.state_dict(), tmp / OPTIMIZER)
            (tmp / META).write_text(json.dumps({"name": name, "steps_applied": state.steps_applied}))
            _move_into_place(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"path": str(directory), "steps_applied": state.steps_applied}

    def load(self, name: str, directory: Path, with_optimizer: bool) -> dict:
        """Load a saved adapter into ``name`` (rebuilt with the saved LoRA config when it is new or
        differs; the active adapter stays active). ``with_optimizer``: restore its AdamW state and
        step count too; otherwise the optimiser starts fresh at step 0."""
        from peft import LoraConfig
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        self._check(name, exists=None)
        directory = Path(directory)
        for f in (WEIGHTS, CONFIG, META) + ((OPTIMIZER,) if with_optimizer else ()):
            if not (directory / f).is_file():
                raise FileNotFoundError(f"LoRA adapter {directory}: missing {f}")
        config = LoraConfig.from_pretrained(str(directory))
        if name not in self.states or _shape(self.model.peft_config[name]) != _shape(config):
            self._rebuild(name, config)
        state = self.states[name]
        for p in self.parameters(name):
            p.grad = None
        state.optimizer, state.steps_applied = self.trainer.new_optimizer(self.parameters(name)), 0
        result = set_peft_model_state_dict(self.model, load_file(str(directory / WEIGHTS)), adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"LoRA adapter {directory}: {len(missing)} tensors missing, "
                             f"{len(result.unexpected_keys)} unexpected (e.g. {(missing + result.unexpected_keys)[0]})")
        if with_optimizer:
            device = self.trainer.device
            state.optimizer.load_state_dict(torch.load(directory / OPTIMIZER, map_location=device, weights_only=True))
            state.steps_applied = json.loads((directory / META).read_text())["steps_applied"]
        return {"name": name, "rank": config.r, "steps_applied": state.steps_applied, "optimizer": with_optimizer}

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """The adapter's A and B matrices (the parameters its optimiser updates)."""
        from peft.tuners.lora import LoraLayer

        return [p for m in self.model.modules() if isinstance(m, LoraLayer) and name in m.lora_A
                for p in (*m.lora_A[name].parameters(), *m.lora_B[name].parameters())]

    def _build(self, name: str, config, seed: int | None, active: str) -> int:
        """Add adapter ``name`` (seeded) with a fresh TrainState; ``active`` is then the active
        adapter, the only trainable one."""
        if seed is None:
            seed = self.trainer.cfg.seed + self._created
        self._created += 1
        devices = [self.trainer.device] if self.trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the learner's own RNG stream is untouched
            torch.manual_seed(seed)
            self.model.add_adapter(name, config)
        self.states[name] = TrainState(self.trainer.new_optimizer(self.parameters(name)))
        self.model.set_adapter(active)
        return seed

    def _rebuild(self, name: str, config) -> None:
        """(Re)create ``name`` with ``config``, keeping the active adapter active."""
        active = self.active  # peft picks another when the active one is deleted
        if name in self.states:
            self.model.delete_adapter(name)
            del self.states[name]
        self._build(name, config, None, active)
        self.trainer.state = self.states[active]

    def _check(self, name: str, exists: bool | None = True) -> None:
        """Tenants need one learner process; ``name`` must exist (True), be new (False); a name
        that may be new (False, None) must be valid."""
        world = self.trainer.dp.world
        if world > 1:
            raise ValueError(f"LoRA tenants need one learner process (meshes.learner.procs = 1), not {world}")
        if exists and name not in self.states:
            raise ValueError(f"no LoRA adapter {name!r} (have {sorted(self.states)})")
        if exists is False and name in self.states:
            raise ValueError(f"LoRA adapter {name!r} already exists")
        if not exists and (not _NAME.fullmatch(name) or name in "lora_"):
            raise ValueError(f"LoRA adapter name {name!r}: use letters, digits, '_' or '-' (and not part of 'lora_')")


def _shape(config) -> tuple:
    """What makes two LoRA configs build different adapters."""
    return (config.r, config.lora_alpha, sorted(config.target_modules), config.lora_dropout, config.use_rslora)


def _move_into_place(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        tmp.rename(directory)
        return
    old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
    directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
