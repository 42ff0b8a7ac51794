"""The panels of a run report, as data: which metric keys each one plots, with what labels and
units. `dashboard.py` draws them; adding a panel is adding an entry to `PANELS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from meshrl.metrics.curves import draw_reward_accuracy
from meshrl.report.runs import STALENESS_PREFIX


@dataclass(frozen=True)
class Series:
    """One line: ``key`` of the records of ``kind`` against step."""

    key: str
    label: str
    kind: str = "train"
    per: str | None = None
    """Plot ``record[key] / record[per]`` (a rate from a count and its seconds)."""
    right: bool = False
    """On the panel's second y axis (`Panel.ylabel_right`)."""
    ls: str = "-"
    """Line style for a single run (several runs: each series its own style)."""


@dataclass(frozen=True)
class Panel:
    """One axes of the dashboard."""

    title: str
    ylabel: str
    series: tuple[Series, ...] = ()
    ylabel_right: str | None = None
    logy: bool = False
    share_prefix: str | None = None
    """Instead of lines: the share of samples per value of the `<prefix><value>` counts."""
    draw: Callable | None = None
    """Instead of lines: ``draw(ax, records, color) -> lines`` draws the panel (shared with another
    figure)."""


PANELS: tuple[Panel, ...] = (
    Panel("Reward and held-out accuracy", "fraction (0-1)", draw=draw_reward_accuracy),
    Panel("Loss terms", "loss (per token)", (
        Series("loss/grpo", "GRPO"),
        Series("loss/sdpo_jsd", "SDPO JSD (unweighted)"),
        Series("loss/replay_dpo", "replay DPO (unweighted)"),
        Series("loss/total", "total (weighted sum)", ls="--"),
        Series("train/nll", "SFT NLL (train)"),  # meshrl sft
        Series("eval/nll", "SFT NLL (held-out)", kind="eval", ls="--"),
        Series("train/dpo_loss", "offline DPO (train)"),  # meshrl sft --pairs
        Series("eval/dpo_loss", "offline DPO (held-out)", kind="eval", ls="--"),
    )),
    Panel("Sampler vs learner mismatch KL", "KL (nats / token)", (
        Series("train/kl_sampler_learner_k1", "k1 estimator"),
        Series("train/kl_sampler_learner_k3", "k3 estimator"),
    )),
    Panel("Policy entropy", "entropy (nats / token)", (Series("train/entropy", "entropy"),)),
    Panel("Clip fraction", "fraction of tokens", (
        Series("train/clip_fraction", "all clipped"),
        Series("train/clip_fraction_low", "low side (A<0, ratio < 1-eps_low)"),
        Series("train/clip_fraction_high", "high side (A>0, ratio > 1+eps_high)"),
    )),
    Panel("Throughput", "tokens / s (log scale)", (
        Series("gen/tokens_per_s", "generation (sampled tokens / generate s)"),
        Series("train/tokens", "training (trained tokens / learner s)", per="train/seconds"),
    ), logy=True),
    Panel("Step time and its parts", "seconds", (
        Series("timing/step_s", "whole step"),
        Series("timing/generate_s", "generate"),
        Series("timing/train_s", "train"),
        Series("timing/sync_s", "weight sync"),
    )),
    Panel("Weight sync", "pull time (s)", (
        Series("sync/pull_s", "pull time (slowest generator)"),
        Series("sync/pull_gbps", "pull bandwidth", right=True),
    ), ylabel_right="GB/s"),
    Panel("Staleness (async)", "share of the step's samples", share_prefix=STALENESS_PREFIX),
)
