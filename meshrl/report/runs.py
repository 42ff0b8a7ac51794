"""A run as `meshrl report` sees it: its records read back from `metrics.jsonl`, and the derived
quantities the dashboard and the summary share (series against step, wall time, faults, staleness
shares). Pure functions on records, apart from `load_run`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from meshrl.metrics.records import MetricsFileError, read_metrics

KINDS = ("train", "eval", "fault")
STALENESS_PREFIX = "staleness/"


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message is one line naming the file."""


@dataclass
class Run:
    """One run's records, split by kind. `train` and `eval` hold one record per step (the last one
    logged for it), sorted by step; `faults` keeps file order."""

    name: str
    path: Path
    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read ``run_dir``/metrics.jsonl; raises `ReportError` for a missing directory or file, an
    empty file, a malformed line (named by file:line) or a file with no meshrl record in it."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ReportError(f"{path}: no such file (is {run_dir} a run directory written by `meshrl train`?)")
    try:
        records = read_metrics(path)
    except MetricsFileError as e:  # names file:line
        raise ReportError(str(e)) from None
    except ValueError as e:  # bytes that are not UTF-8
        raise ReportError(f"{path}: not a text file ({e})") from None
    except OSError as e:
        raise ReportError(f"{path}: {e.strerror}") from None
    if not records:
        raise ReportError(f"{path} is empty: the run logged no step yet")
    return runs_from_records(records, name or run_dir.name, run_dir, source=path)


def runs_from_records(records: list[dict], name: str, path: Path, source: Path | None = None) -> Run:
    """A `Run` from records already read; raises `ReportError` if none is a train, eval or fault
    record with a numeric step."""
    run = Run(name, Path(path))
    by_step: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    for r in records:
        kind, step = r.get("kind"), r.get("step")
        if kind not in KINDS or not isinstance(step, (int, float)):
            continue
        if kind == "fault":
            run.faults.append(r)
        else:
            by_step[kind][int(step)] = r  # a step redone after a recovery: the last record counts
    run.train = [by_step["train"][s] for s in sorted(by_step["train"])]
    run.eval = [by_step["eval"][s] for s in sorted(by_step["eval"])]
    if not (run.train or run.eval or run.faults):
        raise ReportError(f"{source or path}: no train, eval or fault record (not a metrics file of `meshrl train`)")
    return run


def values(records: list[dict], key: str, per: str | None = None) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over ``records`` that log it as a number; with ``per``, the value
    is ``record[key] / record[per]`` (records with ``per`` missing or zero are left out)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if per is not None:
            d = r.get(per)
            if not isinstance(d, (int, float)) or d == 0:
                continue
            v = v / d
        xs.append(r["step"])
        ys.append(float(v))
    return xs, ys


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def elapsed_minutes(run: Run) -> tuple[list[int], list[float]] | None:
    """(steps, elapsed minutes) of the train records, or None when the clock is not usable for an
    axis: fewer than two points, or a clock that restarts (a run resumed in a new process)."""
    steps, secs = values(run.train, "elapsed_s")
    if len(steps) < 2 or any(b < a for a, b in zip(secs, secs[1:])):
        return None
    return steps, [s / 60 for s in secs]


def wall_seconds(run: Run) -> float | None:
    """Seconds from the start of the run to its last step: `elapsed_s` of the last train record,
    summed over the processes of a resumed run (each one restarts the clock)."""
    _, secs = values(run.train, "elapsed_s")
    if not secs:
        return None
    total = 0.0
    for a, b in zip(secs, secs[1:]):
        if b < a:
            total += a
    return total + secs[-1]


def staleness_levels(run: Run) -> list[int]:
    """The staleness values (policy versions behind) any train record counts samples for."""
    found = {k[len(STALENESS_PREFIX):] for r in run.train for k in r if k.startswith(STALENESS_PREFIX)}
    return sorted(int(k) for k in found if k.isdigit())


def staleness_counts(records: list[dict], levels: list[int]) -> list[float]:
    """Samples of ``records`` at each staleness in ``levels``."""
    return [sum(float(r.get(f"{STALENESS_PREFIX}{k}") or 0) for r in records) for k in levels]


def staleness_shares(records: list[dict], levels: list[int]) -> list[float]:
    """Share of the samples of ``records`` at each staleness in ``levels`` (zeros when none)."""
    counts = staleness_counts(records, levels)
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def fault_label(fault: dict) -> str:
    """Short text for a fault marker: the mesh (or host) and the recovery time."""
    who = fault.get("mesh") or fault.get("host") or "fault"
    rec = fault.get("recovery_s")
    return f"{who} {rec:.1f}s" if isinstance(rec, (int, float)) else str(who)


def fault_minutes(run: Run, fault: dict) -> float | None:
    """About when the fault happened: elapsed minutes at the last train record before its step (the
    step it struck started then), if the run logs its clock."""
    before = [r["elapsed_s"] for r in run.train
              if r["step"] < fault["step"] and isinstance(r.get("elapsed_s"), (int, float))]
    return before[-1] / 60 if before else None
