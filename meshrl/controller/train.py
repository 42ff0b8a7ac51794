"""`meshrl train`: set up the run directory, spawn the meshes, run the GRPO loop, write results."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

from meshrl.config.base import to_yaml
from meshrl.config.run import RunConfig

log = logging.getLogger("meshrl")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked."""


def make_run_dir(cfg: RunConfig, overwrite: bool) -> Path:
    """Create `output.dir/output.name`; an existing non-empty directory needs `--overwrite`."""
    name = cfg.output.name or f"{cfg.task.kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.output.dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise RunDirError(f"run directory {run_dir} already holds a run: pass --overwrite to replace it")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("meshrl").setLevel(logging.INFO)


def train_main(cfg: RunConfig, resume: str | None = None, overwrite: bool = False) -> int:
    """Entry point of `meshrl train`; returns the process exit code."""
    if resume is not None:
        print("meshrl: --resume is not available yet (checkpointing arrives with fault tolerance)", file=sys.stderr)
        return 2
    _setup_logging()
    try:
        run_dir = make_run_dir(cfg, overwrite)
    except RunDirError as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return 2
    result = run_training(cfg, run_dir)
    print(summary_text(result, run_dir))
    return 0


def run_training(cfg: RunConfig, run_dir: Path) -> dict:
    """Spawn the meshes, train for `trainer.steps`, evaluate, and write metrics and curves."""
    from tqdm import tqdm

    from meshrl.controller.metrics import MetricsLogger, plot_curves, read_metrics
    from meshrl.controller.runtime import Runtime

    t_start = time.perf_counter()
    result: dict = {"steps": 0, "evals": []}
    metrics = MetricsLogger(run_dir, cfg.output.tensorboard, cfg.output.wandb_project, run_dir.name,
                            cfg.model_dump(mode="json"))
    try:
        with Runtime(cfg) as runtime:
            loop = runtime.loop
            tc = cfg.trainer

            def run_eval(step: int) -> None:
                record = {"kind": "eval", "step": step, "version": loop.version, **loop.evaluate()}
                metrics.log(record)
                result["evals"].append(record)
                log.info("eval at step %d: accuracy %.3f", step, record["eval/accuracy"])

            if tc.eval.at_start:
                run_eval(0)
            bar = tqdm(range(1, tc.steps + 1), desc="train", disable=not tc.progress, dynamic_ncols=True)
            for step in bar:
                record, _ = loop.step()
                record.update(kind="train", step=step, elapsed_s=time.perf_counter() - t_start)
                metrics.log(record)
                result["steps"] = step
                bar.set_postfix(reward=f"{record['reward/mean']:.2f}", step_s=f"{record['timing/step_s']:.1f}")
                if tc.eval.every and step % tc.eval.every == 0 and step != tc.steps:
                    run_eval(step)
            if tc.eval.every or tc.eval.at_start:
                run_eval(tc.steps)
    finally:
        metrics.close()
    records = read_metrics(metrics.path)
    plot_curves(records, run_dir / "curves.png", title=f"{cfg.task.kind}: {cfg.model.name_or_path}")
    train = [r for r in records if r.get("kind") == "train"]
    result["mean_step_s"] = sum(r["timing/step_s"] for r in train) / max(len(train), 1)
    result["wall_s"] = time.perf_counter() - t_start
    return result


def summary_text(result: dict, run_dir: Path) -> str:
    evals = result.get("evals", [])
    lines = [f"run directory: {run_dir}", f"steps: {result['steps']}, mean step {result.get('mean_step_s', 0):.1f}s, "
             f"wall {result.get('wall_s', 0):.0f}s"]
    if evals:
        lines.append("held-out accuracy: " + " -> ".join(f"{e['eval/accuracy']:.1%} (step {e['step']})" for e in evals))
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}; curves: {run_dir / 'curves.png'}")
    return "\n".join(lines)
