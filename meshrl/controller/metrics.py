"""Run metrics: one JSON line per step (plus optional TensorBoard / W&B) and PNG curves."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

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

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config)

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


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(records: list[dict], out_png: Path, title: str = "") -> Path:
    """Reward (training samples) and held-out accuracy against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train], label="train reward (mean)", alpha=0.7)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="held-out greedy accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
