"""Run metrics: one JSON line per step (plus optional TensorBoard / W&B), and reading them back."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from meshrl.jsonl import read_objects

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends flat metric dicts to `metrics.jsonl`; mirrors them to TensorBoard / W&B if asked."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb_project: str | None = None,
                 run_name: str | None = None, config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(run_dir))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        step = int(record.get("step", 0))
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop train/eval records past ``step`` (they are about to be redone after a resume);
        fault events stay."""
        self._file.close()
        records = read_metrics(self.path)
        kept = [r for r in records if r.get("kind") == "fault" or int(r.get("step", 0)) <= step]
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


class MetricsFileError(ValueError):
    """A line of a metrics.jsonl file is not a JSON object; the message names file:line."""


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file (blank lines skipped); a line that is not a JSON object
    raises `MetricsFileError` naming ``path:line``."""
    return [record for _, record in read_objects(path, MetricsFileError)]
