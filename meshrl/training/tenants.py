"""LoRA tenants: several LoRA adapters trained on one base model in one learner (peft multi-adapter),
each with its own optimizer (AdamW, or Dimuon: meshrl.training.optimizers; chosen when it is
created), optimizer state and step count.

One adapter is active at a time: PolicyTrainer's forward / backward passes, `scale_grads`,
`optim_step`, `inference_state_dict` (merged weights) and adapter sync act on it alone. Gradients
accumulated on an adapter live on its own parameters, so they stay with it across switches until
its next `optim_step`. The adapter built at start from `learner.lora` is named ``default``.

A saved adapter is a directory: a PEFT adapter (``adapter_model.safetensors`` and
``adapter_config.json``, loadable by ``peft.PeftModel.from_pretrained``), its AdamW state
(``optimizer.pt``) and ``tenant.json`` (``steps_applied``, and ``optimizer``: which optimizer's
state that is). It is written into a temporary sibling
directory and renamed into place, so a reader never sees a partial one. `snapshot` copies an
adapter's state between two calls and writes it in the background (meshrl.training.snapshots);
`restore` loads the newest snapshot written, so a replacement learner can take a tenant back.

Tenants need a single learner process: with data-parallel learners the calls raise.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from meshrl.training.optimizers import ADAMW, OPTIMIZERS, optimizer_kind
from meshrl.training.snapshots import (CONFIG, META, OPTIMIZER, WEIGHTS, AdapterState, SnapshotWriter, clear_partial,
                                       cpu_copy, latest_snapshot, write_adapter)

DEFAULT = "default"
"""The adapter built at start from `learner.lora`."""
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SNAPSHOT_WAIT_S = 600.0
"""Longest wait for a snapshot written before its call returns (`snapshot` with ``wait``)."""
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
        self.snapshots = SnapshotWriter()
        self._snapshot_roots: dict[str, Path] = {}  # adapter -> where its snapshots go

    @property
    def model(self):
        return self.trainer.model

    @property
    def active(self) -> str:
        return self.model.active_adapter

    def add(self, name: str, rank: int, alpha: float | None = None, seed: int | None = None, train_mlp: bool = True,
            train_attn: bool = True, train_unembed: bool = False, optimizer: str = ADAMW) -> dict:
        """A new adapter (inactive, a fresh ``optimizer``: AdamW or Dimuon) initialised from
        ``seed`` (default: the learner seed plus the number of adapters built before it) on the
        attention and/or MLP projections and, with ``train_unembed``, the unembedding (untied
        models only)."""
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"add_adapter {name!r}: optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
        self._check(name, exists=False)
        targets = ((ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
                   + ((self._unembedding(name),) if train_unembed else ()))
        if not targets:
            raise ValueError(f"add_adapter {name!r}: train_attn, train_mlp and train_unembed are all false: "
                             "nothing to train")
        if rank < 1:
            raise ValueError(f"add_adapter {name!r}: rank must be >= 1, got {rank}")
        from peft import LoraConfig

        lora = self.trainer.cfg.lora
        config = LoraConfig(r=rank, lora_alpha=lora.alpha if alpha is None else alpha, lora_dropout=lora.dropout,
                            target_modules=list(targets), bias="none")
        seed = self._build(name, config, seed, self.active, optimizer)
        return {"name": name, "seed": seed, "params": sum(p.numel() for p in self.parameters(name))}

    def _unembedding(self, name: str) -> str:
        """The module name of the model's unembedding (output projection); ValueError when it is
        tied to the input embedding: a LoRA on it would change the embedding too once merged."""
        base = self.model.get_base_model()
        head = base.get_output_embeddings()
        if head.weight is base.get_input_embeddings().weight:
            raise ValueError(f"add_adapter {name!r}: train_unembed=True needs an untied unembedding; this model "
                             "ties it to the input embedding (tie_word_embeddings)")
        return next(module_name for module_name, module in base.named_modules() if module is head)

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
        if name in self._snapshot_roots:
            self.snapshots.discard(name, self._snapshot_roots.pop(name))

    def capture(self, name: str) -> AdapterState:
        """Copies of the adapter's weights, LoRA config, AdamW state and step count, as they are now."""
        from peft.utils import get_peft_model_state_dict

        self._check(name)
        state = self.states[name]
        # the LoRA matrices only, never the base weights of a targeted unembedding
        weights = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        return AdapterState(name, cpu_copy(weights),
                            copy.deepcopy(self.model.peft_config[name]), cpu_copy(state.optimizer.state_dict()),
                            state.steps_applied, optimizer_kind(state.optimizer))

    def save(self, name: str, directory: Path) -> dict:
        """Write the adapter's weights, LoRA config, AdamW state and step count into ``directory``
        (replaced if it exists)."""
        state = self.capture(name)
        write_adapter(state, Path(directory))
        return {"path": str(directory), "steps_applied": state.steps_applied}

    def snapshot(self, name: str, root: Path, mark: int, wait: bool) -> dict:
        """Copy the adapter's state now (it must hold no accumulated gradient: right after
        `optim_step` or a load) and write it as snapshot ``mark`` under ``root`` in the background;
        ``wait``: return once it is on disk. ``{durable}``: the mark of its newest snapshot on disk."""
        params = self.parameters(name)
        if any(p.grad is not None for p in params):
            raise ValueError(f"snapshot of LoRA adapter {name!r}: it holds accumulated gradients (snapshots are "
                             "taken after optim_step)")
        self.snapshots.submit(self.capture(name), Path(root), mark)
        self._snapshot_roots[name] = Path(root)
        durable = self.snapshots.wait(name, SNAPSHOT_WAIT_S) if wait else self.snapshots.durable(name)
        return {"durable": durable}

    def restore(self, name: str, root: Path) -> dict:
        """Load adapter ``name`` (created if new) from its newest snapshot under ``root``, with its
        AdamW state and step count: ``{name, rank, steps_applied, optimizer, mark}``.
        FileNotFoundError if it has none."""
        clear_partial(root, name)
        found = latest_snapshot(root, name)
        if found is None:
            raise FileNotFoundError(f"LoRA adapter {name!r}: no snapshot under {root}")
        mark, directory = found
        out = self.load(name, directory, with_optimizer=True)
        self._snapshot_roots[name] = Path(root)
        return {**out, "mark": mark}

    def load(self, name: str, directory: Path, with_optimizer: bool, optimizer: str | None = None) -> dict:
        """Load a saved adapter into ``name`` (rebuilt with the saved LoRA config when it is new or
        differs; the active adapter stays active). ``with_optimizer``: restore its optimizer (the
        saved one's kind; ``optimizer``, if given, must name it), its state and step count too;
        otherwise a fresh ``optimizer`` (default: the adapter's own, AdamW for a new one) starts at
        step 0. ``{name, rank, steps_applied, optimizer, optimizer_type}``."""
        from peft import LoraConfig
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        self._check(name, exists=None)
        directory = Path(directory)
        for f in (WEIGHTS, CONFIG, META) + ((OPTIMIZER,) if with_optimizer else ()):
            if not (directory / f).is_file():
                raise FileNotFoundError(f"LoRA adapter {directory}: missing {f}")
        config = LoraConfig.from_pretrained(str(directory))
        kind = self._optimizer_to_load(name, directory, with_optimizer, optimizer)
        if name not in self.states or _shape(self.model.peft_config[name]) != _shape(config):
            self._rebuild(name, config)
        state = self.states[name]
        for p in self.parameters(name):
            p.grad = None
        state.optimizer, state.steps_applied = self.trainer.new_optimizer(self.parameters(name), kind), 0
        result = set_peft_model_state_dict(self.model, load_file(str(directory / WEIGHTS)), adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"LoRA adapter {directory}: {len(missing)} tensors missing, "
                             f"{len(result.unexpected_keys)} unexpected (e.g. {(missing + result.unexpected_keys)[0]})")
        if with_optimizer:
            device = self.trainer.device
            state.optimizer.load_state_dict(torch.load(directory / OPTIMIZER, map_location=device, weights_only=True))
            state.steps_applied = json.loads((directory / META).read_text())["steps_applied"]
        return {"name": name, "rank": config.r, "steps_applied": state.steps_applied, "optimizer": with_optimizer,
                "optimizer_type": kind}

    def _optimizer_to_load(self, name: str, directory: Path, with_optimizer: bool, optimizer: str | None) -> str:
        saved = json.loads((directory / META).read_text()).get("optimizer", ADAMW)
        if with_optimizer:
            if optimizer not in (None, saved):
                raise ValueError(f"LoRA adapter {directory}: its optimizer state is {saved!r}'s, not {optimizer!r}")
            return saved
        if optimizer is not None:
            if optimizer not in OPTIMIZERS:
                raise ValueError(f"load of {name!r}: optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
            return optimizer
        return optimizer_kind(self.states[name].optimizer) if name in self.states else ADAMW

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """The adapter's A and B matrices (the parameters its optimiser updates)."""
        from peft.tuners.lora import LoraLayer

        return [p for m in self.model.modules() if isinstance(m, LoraLayer) and name in m.lora_A
                for p in (*m.lora_A[name].parameters(), *m.lora_B[name].parameters())]

    def _build(self, name: str, config, seed: int | None, active: str, optimizer: str = ADAMW) -> int:
        """Add adapter ``name`` (seeded) with a fresh TrainState; ``active`` is then the active
        adapter, the only trainable one."""
        if seed is None:
            seed = self.trainer.cfg.seed + self._created
        self._created += 1
        devices = [self.trainer.device] if self.trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the learner's own RNG stream is untouched
            torch.manual_seed(seed)
            self.model.add_adapter(name, config)
        self.states[name] = TrainState(self.trainer.new_optimizer(self.parameters(name), optimizer))
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
