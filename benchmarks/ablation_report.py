"""The ablation's verdict from its run files (benchmarks/results/ablation/*.json, written by
benchmarks/ablation.py): per task and arm the held-out accuracy curve (mean and std over seeds),
accuracy at equal steps and at equal training seconds, each arm's difference from its own seed's
baseline, and how soon it reaches the baseline's final accuracy. Writes
benchmarks/results/ablation.json (rendered by benchmarks/tables.py) and ablation.png.

    python benchmarks/ablation_report.py      # rebuild both from the run files

Equal wall-clock: an arm's accuracy at its last eval whose training seconds (the sum of its steps'
`timing/step_s`, evals excluded) do not exceed its seed's baseline's whole run. Reaching the
baseline: the first eval at which the arm's accuracy is at least its seed's baseline's final
accuracy, in steps and in training seconds, each as a fraction of the baseline run's.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SETTINGS = ("steps", "eval_every", "eval_size")

from benchmarks.ablation import ARMS, MAIN_ARMS, ROUNDS, round_name  # noqa: E402 (the repository root is on sys.path above)


def spread(values: list[float]) -> dict:
    """mean, population std and the values themselves."""
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "values": values} if values else {}


def accuracy_within(run: dict, train_s: float) -> float:
    """The run's accuracy at its last eval within ``train_s`` training seconds."""
    return [e["accuracy"] for e in run["evals"] if e["train_s"] <= train_s * (1 + 1e-9)][-1]


def reaching(run: dict, target: float) -> dict | None:
    """The first eval at which ``run`` reaches ``target`` accuracy (step, training seconds)."""
    for e in run["evals"]:
        if e["step"] > 0 and e["accuracy"] >= target:
            return {"step": e["step"], "train_s": e["train_s"]}
    return None


def arm_summary(runs: list[dict], baselines: dict[int, dict]) -> dict:
    """One arm's figures over its seeds, each paired with the same seed's baseline run."""
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    curve = []
    for step in steps:
        at = [e for r in runs for e in r["evals"] if e["step"] == step]
        acc = [e["accuracy"] for e in at]
        curve.append({"step": step, "mean": statistics.fmean(acc), "std": statistics.pstdev(acc),
                      "train_s": statistics.fmean(e["train_s"] for e in at), "seeds": len(at)})
    out = {"seeds": [r["seed"] for r in runs], "curve": curve,
           "final": spread([r["evals"][-1]["accuracy"] for r in runs]),
           "mean_step_s": statistics.fmean(r["mean_step_s"] for r in runs),
           "mean_parts_s": {k: statistics.fmean(r["mean_parts_s"][k] for r in runs) for k in runs[0]["mean_parts_s"]},
           "steps_with_nonzero": {k: sum(r["steps_with_nonzero"][k] for r in runs) for k in runs[0]["steps_with_nonzero"]},
           "load_1m_mean": statistics.fmean(r["load_1m"]["mean"] for r in runs)}
    paired = [(r, baselines[r["seed"]]) for r in runs if r["seed"] in baselines]
    if not paired:
        return out
    out["step_vs_baseline"] = spread([r["mean_step_s"] / b["mean_step_s"] for r, b in paired])
    out["diff_final"] = spread([r["evals"][-1]["accuracy"] - b["evals"][-1]["accuracy"] for r, b in paired])
    equal_wall = [accuracy_within(r, b["train_s"]) for r, b in paired]
    out["equal_wall"] = spread(equal_wall)
    out["diff_equal_wall"] = spread([a - b["evals"][-1]["accuracy"] for a, (_, b) in zip(equal_wall, paired)])
    reached = []
    for r, b in paired:
        hit = reaching(r, b["evals"][-1]["accuracy"])
        reached.append(None if hit is None else {"seed": r["seed"], "steps_frac": hit["step"] / b["steps"],
                                                 "train_s_frac": hit["train_s"] / b["train_s"]})
    out["reach_baseline_final"] = reached
    return out


def summarise(runs: list[dict]) -> dict:
    """Per task: the baseline's settings (runs with other settings are left out and listed), and
    every arm's summary."""
    tasks: dict[str, dict] = {}
    for task in sorted({r["task"] for r in runs}, key=lambda t: (t != "arithmetic", t)):
        of_task = [r for r in runs if r["task"] == task]
        base = [r for r in of_task if r["arm"] == "baseline"] or of_task
        s = {k: base[-1][k] for k in SETTINGS}
        kept = [r for r in of_task if all(r[k] == s[k] for k in SETTINGS)]
        baselines = {r["seed"]: r for r in kept if r["arm"] == "baseline"}
        arms = {}
        for arm in dict.fromkeys(r["arm"] for r in kept):
            arms[arm] = arm_summary(sorted((r for r in kept if r["arm"] == arm), key=lambda r: r["seed"]), baselines)
        tasks[task] = {"settings": s, "arms": arms,
                       "left_out": sorted(f"{r['arm']}-s{r['seed']}" for r in of_task if r not in kept)}
    return tasks


MAIN_COLOURS = ("black", "tab:blue", "tab:orange", "tab:green")
SWEEP_COLOURS = ("tab:red", "tab:purple", "tab:brown", "gold", "tab:olive", "tab:cyan", "lime", "tab:pink", "tab:gray",
                 "navy", "magenta", "maroon", "teal")
COLOURS = {**dict(zip(MAIN_ARMS, MAIN_COLOURS)),
           **dict(zip((a for a in ARMS if a not in MAIN_ARMS), itertools.cycle(SWEEP_COLOURS)))}
"""Each arm of benchmarks/ablation.py's plan, in its order, and its colour in the plot."""


def _runs_of(runs: list[dict], task: str, t: dict, arm: str, seed: int | None = None) -> list[dict]:
    return [r for r in runs if r["arm"] == arm and r["task"] == task and (seed is None or r["seed"] == seed)
            and all(r[k] == t["settings"][k] for k in SETTINGS)]


def _main_row(row, task: str, t: dict, runs: list[dict]) -> None:
    """The main arms over their seeds: by step (mean ± std, thin per seed) and by training time."""
    by_step, by_time = row
    for arm in (a for a in MAIN_ARMS if a in t["arms"]):
        a, c = t["arms"][arm], COLOURS[arm]
        steps = [p["step"] for p in a["curve"]]
        mean = [100 * p["mean"] for p in a["curve"]]
        std = [100 * p["std"] for p in a["curve"]]
        for r in _runs_of(runs, task, t, arm):
            by_step.plot([e["step"] for e in r["evals"]], [100 * e["accuracy"] for e in r["evals"]],
                         color=c, alpha=0.25, linewidth=0.8)
        label = f"{arm} ({len(a['seeds'])} seed{'s' if len(a['seeds']) > 1 else ''})"
        by_step.plot(steps, mean, color=c, linewidth=2, label=label)
        if len(a["seeds"]) > 1:
            by_step.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                 color=c, alpha=0.12)
        by_time.plot([p["train_s"] / 60 for p in a["curve"]], mean, color=c, linewidth=2, marker="o", markersize=3,
                     label=label)
    by_step.set(xlabel="step", ylabel="held-out greedy accuracy (%)",
                title=f"{task}: mean ± std over seeds (thin: each seed)")
    by_time.set(xlabel="training minutes (evals excluded), mean over seeds", ylabel="held-out greedy accuracy (%)",
                title=f"{task}: accuracy at equal wall-clock")


def _sweep_row(row, task: str, t: dict, runs: list[dict], seed: int) -> None:
    """Seed ``seed``'s runs of every arm, the sweeps (dashed) beside the main arms of the same seed."""
    by_step, by_time = row
    for arm in (a for a in ARMS if a in t["arms"]):
        for r in _runs_of(runs, task, t, arm, seed):
            style = {"color": COLOURS[arm], "linestyle": "-" if arm in MAIN_ARMS else "--", "linewidth": 1.6,
                     "label": arm}
            acc = [100 * e["accuracy"] for e in r["evals"]]
            by_step.plot([e["step"] for e in r["evals"]], acc, **style)
            by_time.plot([e["train_s"] / 60 for e in r["evals"]], acc, marker="o", markersize=3, **style)
    by_step.set(xlabel="step", ylabel="held-out greedy accuracy (%)",
                title=f"{task}, seed {seed}: the sweeps (dashed) beside that seed's main arms")
    by_time.set(xlabel="training minutes (evals excluded)", ylabel="held-out greedy accuracy (%)",
                title=f"{task}, seed {seed}: the sweeps at equal wall-clock")


def plot(tasks: dict, out: Path, runs: list[dict]) -> None:
    """Per task a row of the main arms; per task with sweep arms a row of their seed's runs (a
    one-seed sweep is compared with its own seed's baseline, not with a mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for task, t in tasks.items():
        rows.append((_main_row, task, t, ()))
        sweep_seeds = sorted({r["seed"] for r in runs if r["task"] == task and r["arm"] not in MAIN_ARMS})
        rows += [(_sweep_row, task, t, (seed,)) for seed in sweep_seeds]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 4.2 * len(rows)), squeeze=False)
    for row, (draw, task, t, extra) in zip(axes, rows):
        draw(row, task, t, runs, *extra)
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, ncol=2 if len(ax.get_lines()) > 10 else 1)  # a seed's many sweeps
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_summary(run_files: Path, name: str = "ablation") -> list[Path]:
    """Rebuild ``name``.json and ``name``.png (a round of the ablation: benchmarks/ablation.py
    `ROUNDS`) from the run files in ``run_files``; the paths written."""
    from benchmarks.common import write_result

    runs = [json.loads(p.read_text()) for p in sorted(run_files.glob("*.json"))]
    if not runs:
        return []
    tasks = summarise(runs)
    index = [{"run": f"{r['arm']}-{r['task']}-s{r['seed']}", "commit": r["commit"], "date": r["date"],
              "load_1m_mean": r["load_1m"]["mean"], "faults": r["faults"]} for r in runs]
    path = write_result(name, {"tasks": tasks, "runs": index})
    plot(tasks, RESULTS / f"{name}.png", runs)
    return [path, RESULTS / f"{name}.png"]


if __name__ == "__main__":
    for round_ in ROUNDS:
        if (RESULTS / round_name(round_)).is_dir():
            for written in write_summary(RESULTS / round_name(round_), round_name(round_)):
                print("wrote", written)
