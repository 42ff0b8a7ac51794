"""The reward/accuracy curves of a run (`curves.png`; also the first panel of `meshrl report`)."""

from __future__ import annotations

from pathlib import Path


def draw_reward_accuracy(ax, records: list[dict], color: str | None = None) -> list:
    """Train reward (mean over the step's samples) and held-out greedy accuracy against step on
    ``ax``, in ``color`` (default: one colour each); returns the lines drawn (none when neither is
    logged). `curves.png`, and the reward panel of `meshrl report` (one colour per run)."""
    train = [(r["step"], r["reward/mean"]) for r in records
             if r.get("kind") == "train" and r.get("reward/mean") is not None]
    evals = [(r["step"], r["eval/accuracy"]) for r in records
             if r.get("kind") == "eval" and r.get("eval/accuracy") is not None]
    lines = []
    if train:
        lines += ax.plot(*zip(*train), color=color, alpha=0.7, label="train reward (mean)")
    if evals:
        lines += ax.plot(*zip(*evals), "o-", color=color, label="held-out greedy accuracy")
    ax.set_ylim(-0.02, 1.02)
    return lines


def plot_curves(records: list[dict], out_png: Path, title: str = "") -> Path:
    """`draw_reward_accuracy` alone, as a PNG (a run's `curves.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw_reward_accuracy(ax, records)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
