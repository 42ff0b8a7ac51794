"""`meshrl report`: a run's `metrics.jsonl` as a dashboard PNG and a markdown summary, or several
runs overlaid and compared. Reads run directories only; nothing but the CLI imports it."""

from __future__ import annotations

from pathlib import Path

from meshrl.report.dashboard import DrawnPanel, draw_dashboard
from meshrl.report.runs import ReportError, Run, load_run
from meshrl.report.summary import comparison_markdown, headline, run_markdown

__all__ = ["DrawnPanel", "ReportError", "Run", "load_run", "write_comparison", "write_report"]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path, list[DrawnPanel]]:
    """`report.png` and `report.md` for the run in ``run_dir``, written to ``out_dir`` (default:
    the run directory); returns their paths and the panels drawn. Raises `ReportError`."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "report.png", out / "report.md"
    panels = draw_dashboard([run], png, headline(run))
    md.write_text(run_markdown(run, png.name))
    return png, md, panels


def write_comparison(run_dirs: list[str | Path], out_dir: str | Path = ".") -> tuple[Path, Path, list[DrawnPanel]]:
    """`report-compare.png` (the runs overlaid, one colour each) and `report-compare.md` (one table
    column per run) in ``out_dir``; returns their paths and the panels drawn. Raises `ReportError`."""
    paths = [Path(d) for d in run_dirs]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):  # runs of the same name in different places
        names = [str(p) for p in paths]
    runs = [load_run(p, name) for p, name in zip(paths, names)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "report-compare.png", out / "report-compare.md"
    panels = draw_dashboard(runs, png, "Run comparison")
    md.write_text(comparison_markdown(runs, png.name))
    return png, md, panels
