"""A learner's side of DiLoCo: a DiLoCoSync over a model's trainable parameters (full fine-tuning:
all of them; LoRA: the adapter), and what a learner checkpoint records to rejoin the run.

Rejoining after a resume: the learner loads its checkpoint, then `join` reads the run's newest
outer state (round R). If the checkpoint was taken during round R itself (its recorded round and
round-start hash are R's), the checkpoint's weights are kept: its inner steps since the round began
still count, exactly as if the replica had never stopped. Otherwise (the run moved on meanwhile,
or the checkpoint has no DiLoCo record) the replica continues from round R's outer weights and
momentum and its inner progress since its checkpoint's round is dropped. The round counter is
always the store's: the next round this replica ends is R + 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshrl.config.diloco import DiLoCoConfig
from meshrl.diloco.store import ObjectStore
from meshrl.diloco.sync import DiLoCoSync

CHECKPOINT_FILE = "diloco.json"


class ModelSync:
    """``writer`` False for a data-parallel rank other than its replica's first (it applies the
    same rounds without uploading)."""

    def __init__(self, cfg: DiLoCoConfig, model: torch.nn.Module, writer: bool = True,
                 store: ObjectStore | None = None):
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("diloco.enabled: the model has no trainable parameters")
        self.sync = DiLoCoSync(cfg, store, writer)
        self._checkpoint: dict | None = None  # the DiLoCo record of the checkpoint just loaded

    def join(self) -> dict:
        """Align with the run (see the module docstring): ``{round, hash, rejoined,
        kept_checkpoint_weights}``."""
        record, self._checkpoint = self._checkpoint, None
        local = {k: p.detach().clone() for k, p in self.params.items()} if record is not None else None
        report = self.sync.join(self.params)
        keep = local is not None and record.get("round") == report["round"] and record.get("hash") == report["hash"]
        if keep:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(local[name])
        report["kept_checkpoint_weights"] = int(keep)
        return report

    def step(self) -> dict:
        """End the current round (the DiLoCoSync report)."""
        return self.sync.sync(self.params)

    def save(self, directory: Path) -> None:
        """Record the round this checkpoint belongs to (beside the learner's checkpoint files)."""
        cfg = self.sync.cfg
        record = {"round": self.sync.round, "hash": self.sync.base_hash, "run_id": cfg.run_id,
                  "replica_id": cfg.replica_id}
        (Path(directory) / CHECKPOINT_FILE).write_text(json.dumps(record))

    def load(self, directory: Path) -> None:
        """Remember the checkpoint's record for the next `join` (none: the join adopts the run's
        newest outer state)."""
        path = Path(directory) / CHECKPOINT_FILE
        self._checkpoint = json.loads(path.read_text()) if path.exists() else None
