"""Draw `panels.PANELS` as one PNG: for one run (each series its colour, elapsed minutes on the top
axis), or overlaid for several (each run its colour, each series its line style). Recovery events
(fault records) are dashed vertical lines labelled at the foot of every panel; a panel whose keys no
run logs says so instead of plotting nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.report.panels import PANELS, Panel
from meshrl.report.runs import Run, elapsed_minutes, fault_label, staleness_levels, staleness_shares, values

COLS = 3
LINESTYLES = ("-", "--", ":", "-.")
FAULT_COLOR = "crimson"


@dataclass
class DrawnPanel:
    """What `draw_dashboard` put on one axes: its title, the axes, and how many data artists
    (lines, stacked areas) it drew; 0 means the panel says "not logged"."""

    title: str
    ax: Any
    artists: int


def draw_dashboard(runs: list[Run], out_png: Path, title: str) -> list[DrawnPanel]:
    """Draw every panel for ``runs`` (one run, or several overlaid) into ``out_png``; returns the
    panels drawn, in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = -(-len(PANELS) // COLS)
    fig, axes = plt.subplots(rows, COLS, figsize=(6.4 * COLS, 4.3 * rows), sharex=True, squeeze=False)
    overlay = len(runs) > 1
    colors = [f"C{i % 10}" for i in range(len(runs))] if overlay else [None]
    drawn = []
    for panel, ax in zip(PANELS, axes.flat):
        artists = _draw_panel(ax, panel, runs, colors)
        _decorate(ax, panel, artists, overlay)
        _mark_faults(ax, runs, colors)
        drawn.append(DrawnPanel(panel.title, ax, artists))
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    for ax in axes.flat:
        ax.tick_params(labelbottom=True, labelsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("training step", fontsize=10)
    if not overlay:
        _elapsed_axis(axes[0], runs[0])
    fig.suptitle(title, fontsize=15, fontweight="bold")
    top = 0.955
    if overlay:
        handles = [Line2D([], [], color=c, lw=4, label=r.name) for r, c in zip(runs, colors)]
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.962), ncol=min(len(runs), 6),
                   fontsize=11, frameon=False)
        top = 0.925
    fig.tight_layout(rect=(0, 0, 1, top))
    _save_png(fig, out_png)
    plt.close(fig)
    return drawn


def _save_png(fig, out_png: Path) -> None:
    """Save with a 256-colour palette: the same look (flat colours, thin lines) in about a third of
    the bytes."""
    import io

    from PIL import Image  # a dependency of matplotlib

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(out_png, optimize=True)


def _draw_panel(ax, panel: Panel, runs: list[Run], colors: list) -> int:
    """Draw ``panel``'s data for every run; the number of data artists drawn."""
    overlay = len(runs) > 1
    if panel.draw is not None:
        drawn = [panel.draw(ax, run.train + run.eval, color) for run, color in zip(runs, colors)]
        first = next((lines for lines in drawn if lines), [])
        if first and overlay:  # the series by style; the runs' colours are in the figure legend
            ax.legend(handles=[_proxy(ln.get_label(), ln.get_linestyle(), ln.get_marker()) for ln in first],
                      fontsize=8, loc="best")
        elif first:
            ax.legend(fontsize=8, loc="best")
        return sum(len(lines) for lines in drawn)
    if panel.share_prefix is not None:
        return _draw_shares(ax, runs, colors)
    twin = None
    artists = 0
    for i, s in enumerate(panel.series):
        for run, color in zip(runs, colors):
            xs, ys = values(run.train if s.kind == "train" else run.eval, s.key, s.per)
            if not xs:
                continue
            if s.right and twin is None:
                twin = ax.twinx()
                twin.set_ylabel(panel.ylabel_right, fontsize=10)
                twin.tick_params(labelsize=9)
            target = twin if s.right else ax
            target.plot(xs, ys, color=color or f"C{i}", ls=LINESTYLES[i % len(LINESTYLES)] if overlay else s.ls,
                        marker="." if len(xs) <= 40 else None, lw=1.6, label=s.label)
            artists += 1
    if overlay and artists:  # the series by line style; the runs' colours are in the figure legend
        logged = [(i, s) for i, s in enumerate(panel.series)
                  if any(values(r.train if s.kind == "train" else r.eval, s.key, s.per)[0] for r in runs)]
        ax.legend(handles=[_proxy(s.label + (" (right axis)" if s.right else ""), LINESTYLES[i % len(LINESTYLES)])
                           for i, s in logged], fontsize=8, loc="best")
    elif artists:
        handles = ax.get_legend_handles_labels()[0] + (twin.get_legend_handles_labels()[0] if twin else [])
        ax.legend(handles=handles, fontsize=8, loc="best")
    return artists


def _draw_shares(ax, runs: list[Run], colors: list) -> int:
    """Share of samples per staleness: stacked areas for one run; for several, one line per run:
    the share of samples one or more versions behind."""
    overlay = len(runs) > 1
    artists = 0
    for run, color in zip(runs, colors):
        levels = staleness_levels(run)
        steps = [r for r in run.train if any(staleness_shares([r], levels))]
        if not levels or not steps:
            continue
        xs = [r["step"] for r in steps]
        shares = [staleness_shares([r], levels) for r in steps]
        if overlay:
            stale = [sum(sh for k, sh in zip(levels, row) if k > 0) for row in shares]
            ax.plot(xs, stale, color=color, lw=1.6, marker="." if len(xs) <= 40 else None,
                    label="1 or more versions behind")
            artists += 1
        else:
            import matplotlib.pyplot as plt

            cmap = plt.get_cmap("viridis")
            labels = [f"{k} version{'s' if k != 1 else ''} behind" + (" (on-policy)" if k == 0 else "")
                      for k in levels]
            ax.stackplot(xs, list(zip(*shares)), labels=labels, step="mid", alpha=0.8,
                         colors=[cmap(0.2 + 0.6 * j / max(len(levels) - 1, 1)) for j in range(len(levels))])
            artists += len(levels)
    if artists and overlay:
        ax.set_ylim(-0.03, 1.03)
        ax.legend(handles=[_proxy("samples 1 or more versions behind", "-")], fontsize=8, loc="center right")
    elif artists:
        ax.set_ylim(0, 1.0)
        ax.legend(fontsize=8, loc="center right", framealpha=0.9, title="staleness", title_fontsize=8)
    return artists


def _proxy(label: str, ls: str, marker: str | None = None):
    """A grey legend entry for a series drawn in several runs' colours."""
    from matplotlib.lines import Line2D

    return Line2D([], [], color="0.3", ls=ls, marker=marker if marker not in (None, "None", "") else None,
                  label=label)


def _decorate(ax, panel: Panel, artists: int, overlay: bool) -> None:
    ax.set_title(panel.title, fontsize=12, fontweight="bold")
    if not artists:
        ax.text(0.5, 0.5, "not logged in " + ("these runs" if overlay else "this run"), transform=ax.transAxes,
                ha="center", va="center", fontsize=12, color="0.45", style="italic")
        ax.set_yticks([])
        return
    ax.set_ylabel(panel.ylabel, fontsize=10)
    ax.grid(alpha=0.3)
    if panel.logy:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))


def _mark_faults(ax, runs: list[Run], colors: list) -> None:
    """A dashed vertical line at each fault's step, labelled (mesh, recovery seconds) at the foot of
    the panel."""
    from matplotlib.transforms import blended_transform_factory

    foot = blended_transform_factory(ax.transData, ax.transAxes)
    for run, color in zip(runs, colors):
        for fault in run.faults:
            c = color or FAULT_COLOR
            ax.axvline(fault["step"], color=c, ls="--", lw=1.3, alpha=0.9)
            ax.text(fault["step"], 0.03, f" fault: {fault_label(fault)}", transform=foot, rotation=90, ha="right",
                    va="bottom", fontsize=8, color=c, fontweight="bold",
                    bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1})


def _elapsed_axis(top_row, run: Run) -> None:
    """Elapsed minutes as a second x axis over the top row, when the run's clock allows it."""
    clock = elapsed_minutes(run)
    if clock is None:
        return
    import numpy as np

    steps, minutes = clock
    if steps[0] > 0:  # step 0 is the start of the run
        steps, minutes = [0, *steps], [0.0, *minutes]

    def to_minutes(x):
        return np.interp(x, steps, minutes)

    def to_steps(m):
        return np.interp(m, minutes, steps)

    for ax in top_row:
        if ax.get_visible():
            sec = ax.secondary_xaxis("top", functions=(to_minutes, to_steps))
            sec.set_xlabel("elapsed (min)", fontsize=9)
            sec.tick_params(labelsize=8)
