"""The markdown half of a run report: one table row per quantity (`rows`), a single run's summary
(`run_markdown`) and a comparison with one column per run (`comparison_markdown`)."""

from __future__ import annotations

from meshrl.report.runs import (Run, fault_minutes, mean, staleness_counts, staleness_levels, staleness_shares,
                                values, wall_seconds)

NOT_LOGGED = "not logged in this run"
ENDS = 5  # steps averaged at each end of a noisy series
STEP_PARTS = (("timing/generate_s", "generate"), ("timing/train_s", "train"), ("timing/sync_s", "weight sync"))


def rows(run: Run) -> list[tuple[str, str]]:
    """(quantity, formatted value) for the summary table of ``run``."""
    return [
        ("steps", _steps(run)),
        ("wall time", _minutes(wall_seconds(run))),
        ("mean step time", _step_time(run)),
        ("held-out accuracy", _first_last(run.eval, "eval/accuracy", "{:.1%}")),
        ("train reward (mean)", _first_last(run.train, "reward/mean", "{:.3f}")),
        (f"train reward, mean of the first / last {ENDS} steps", _ends(run.train, "reward/mean")),
        ("generation tokens/s (mean over steps)", _mean_of(values(run.train, "gen/tokens_per_s")[1], "{:,.0f}")),
        ("training tokens/s (mean over steps)",
         _mean_of(values(run.train, "train/tokens", per="train/seconds")[1], "{:,.0f}")),
        ("weight sync (mean)", _sync(run)),
        ("faults", _faults_short(run)),
        ("staleness (share of samples)", _staleness(run)),
    ]


def headline(run: Run) -> str:
    """One line for the dashboard's title: name, steps, wall time, held-out accuracy, faults."""
    parts = [run.name, f"{len(run.train)} steps"]
    wall = wall_seconds(run)
    if wall is not None:
        parts.append(f"{wall / 60:.1f} min")
    if run.eval and not values(run.eval, "eval/accuracy")[0] and values(run.eval, "eval/nll")[0]:  # meshrl sft
        parts.append(f"held-out NLL {_first_last(run.eval, 'eval/nll', '{:.3f}', steps=False)}")
    elif run.eval and values(run.eval, "eval/preference_accuracy")[0]:  # meshrl sft --pairs
        parts.append("held-out preference accuracy "
                     f"{_first_last(run.eval, 'eval/preference_accuracy', '{:.1%}', steps=False)}")
    elif run.eval:
        parts.append(f"held-out accuracy {_first_last(run.eval, 'eval/accuracy', '{:.1%}', steps=False)}")
    if run.faults:
        parts.append(f"{len(run.faults)} fault{'s' if len(run.faults) != 1 else ''} recovered")
    return " · ".join(parts)


def run_markdown(run: Run, png_name: str) -> str:
    """The summary of one run: the table, then its faults and recoveries."""
    lines = [f"# Run report: {run.name}", "", f"Run directory `{run.path}`; dashboard `{png_name}`.", "",
             f"![dashboard]({png_name})", "", "| quantity | value |", "| --- | --- |"]
    lines += [f"| {q} | {_cell(v)} |" for q, v in rows(run)]
    lines += ["", "## Faults and recoveries", ""] + (_fault_lines(run) or ["None."])
    return "\n".join(lines) + "\n"


def comparison_markdown(runs: list[Run], png_name: str) -> str:
    """Runs side by side: one table column per run, then each run's faults."""
    names = [_cell(r.name) for r in runs]
    lines = [f"# Run comparison: {' vs '.join(names)}", "", f"![overlay]({png_name})", "",
             "| quantity | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(runs),
             "| run directory | " + " | ".join(f"`{_cell(str(r.path))}`" for r in runs) + " |"]
    table = [rows(r) for r in runs]
    for i, (quantity, _) in enumerate(table[0]):
        lines.append(f"| {quantity} | " + " | ".join(_cell(t[i][1]) for t in table) + " |")
    for run in runs:
        if run.faults:
            lines += ["", f"## Faults and recoveries: {run.name}", ""] + _fault_lines(run)
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _steps(run: Run) -> str:
    if not run.train:
        return "no train step logged"
    steps = [r["step"] for r in run.train]
    return f"{len(steps)} (steps {steps[0]}-{steps[-1]})"


def _minutes(seconds: float | None) -> str:
    return NOT_LOGGED if seconds is None else f"{seconds / 60:.1f} min ({seconds:.0f} s)"


def _step_time(run: Run) -> str:
    total = mean(values(run.train, "timing/step_s")[1])
    if total is None:
        return NOT_LOGGED
    parts = [(label, mean(values(run.train, key)[1])) for key, label in STEP_PARTS]
    detail = ", ".join(f"{label} {m:.2f} s" for label, m in parts if m is not None)
    return f"{total:.2f} s" + (f" ({detail})" if detail else "")


def _first_last(records: list[dict], key: str, fmt: str, steps: bool = True) -> str:
    xs, ys = values(records, key)
    if not xs:
        return NOT_LOGGED
    ends = [(xs[0], ys[0])] if len(xs) == 1 else [(xs[0], ys[0]), (xs[-1], ys[-1])]
    return " → ".join(fmt.format(y) + (f" (step {x})" if steps else "") for x, y in ends)


def _ends(records: list[dict], key: str) -> str:
    _, ys = values(records, key)
    if len(ys) < 2 * ENDS:
        return f"fewer than {2 * ENDS} steps logged"
    return f"{mean(ys[:ENDS]):.3f} → {mean(ys[-ENDS:]):.3f}"


def _mean_of(ys: list[float], fmt: str) -> str:
    m = mean(ys)
    return NOT_LOGGED if m is None else fmt.format(m)


def _sync(run: Run) -> str:
    pull = mean(values(run.train, "sync/pull_s")[1])
    gbps = mean(values(run.train, "sync/pull_gbps")[1])
    size = values(run.train, "sync/bytes")[1]
    if pull is None and gbps is None:
        return NOT_LOGGED
    parts = [f"pull {pull:.3f} s" if pull is not None else "pull time not logged",
             f"{gbps:.2f} GB/s" if gbps is not None else "GB/s not logged"]
    if size:
        parts.append(f"{size[-1] / 1e9:.3f} GB per version")
    return ", ".join(parts)


def _faults_short(run: Run) -> str:
    if not run.faults:
        return "none"
    each = [f"step {f['step']} {f.get('mesh') or f.get('host') or '?'}"
            + (f" ({f['recovery_s']:.1f} s)" if isinstance(f.get("recovery_s"), (int, float)) else "")
            for f in run.faults]
    return f"{len(run.faults)}: " + "; ".join(each)


def _fault_lines(run: Run) -> list[str]:
    """One bullet per fault record: step, mesh, cause, action, recovery time, when."""
    out = []
    for f in run.faults:
        text = f"- step {f['step']}: `{f.get('mesh') or f.get('host') or '?'}`"
        if f.get("cause"):
            text += f" failed ({' '.join(str(f['cause']).split())})"
        if f.get("action"):
            text += f"; {f['action']}"
        if isinstance(f.get("recovery_s"), (int, float)):
            text += f"; recovered in {f['recovery_s']:.1f} s"
        if isinstance(f.get("resumed_from_step"), int):
            text += f"; training resumed from step {f['resumed_from_step']}"
        at = fault_minutes(run, f)
        if at is not None:
            text += f" (about {at:.1f} min into the run)"
        out.append(text)
    return out


def _staleness(run: Run) -> str:
    levels = staleness_levels(run)
    shares = staleness_shares(run.train, levels)
    if not any(shares):
        return NOT_LOGGED
    total = sum(staleness_counts(run.train, levels))
    return ", ".join(f"{k}: {s:.1%}" for k, s in zip(levels, shares)) + f" of {total:,.0f} samples"
