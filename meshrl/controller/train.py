"""`meshrl train`: set up (or reopen) the run directory, spawn the meshes, run the GRPO loop with
checkpoints and recovery, and write metrics, curves and the final policy."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

from meshrl.config.base import ConfigError, load_config, to_yaml
from meshrl.config.meshes import LEARNER
from meshrl.config.run import RunConfig

log = logging.getLogger("meshrl")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked."""


def make_run_dir(cfg: RunConfig, overwrite: bool) -> Path:
    """Create `output.dir/output.name`; a directory that already holds a run needs `--resume`
    (to continue it) or `--overwrite` (to replace it)."""
    name = cfg.output.name or f"{cfg.task.kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.output.dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise RunDirError(f"run directory {run_dir} already holds a run: pass --resume {run_dir} to continue "
                              "it or --overwrite to replace it")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("meshrl").setLevel(logging.INFO)


def train_main(cfg: RunConfig, resume: str | None = None, overwrite: bool = False,
               hosts_for: Callable[[RunConfig, Path], ContextManager] | None = None) -> int:
    """Entry point of `meshrl train` and `meshrl launch`; returns the process exit code.
    ``hosts_for(cfg, run_dir)`` is a context manager that provides the run's hosts (a launcher's
    job, killed on leaving it); None = this machine."""
    from meshrl.terms import check_config

    _setup_logging()
    try:
        if resume is not None:
            run_dir = Path(resume)
            cfg = load_config(RunConfig, run_dir / "config.yaml")
        check_config(cfg)  # before a run directory is made
        if resume is None:
            run_dir = make_run_dir(cfg, overwrite)
    except (RunDirError, ConfigError) as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return 2
    from meshrl.controller.diloco_link import DiLoCoFailed
    from meshrl.meshes.supervisor import RestartBudgetExceeded
    from meshrl.meshes.group import MeshSpawnError
    from meshrl.meshes.hosts import HostLost

    try:
        with (hosts_for(cfg, run_dir) if hosts_for is not None else contextlib.nullcontext()) as hosts:
            result = run_training(cfg, run_dir, resume=resume is not None, hosts=hosts)
    except (RestartBudgetExceeded, HostLost, MeshSpawnError, DiLoCoFailed) as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return 1
    print(summary_text(result, run_dir))
    return 0


def run_training(cfg: RunConfig, run_dir: Path, resume: bool = False, hosts=None,
                 actors: dict[str, type] | None = None, session=None) -> dict:
    """Spawn the meshes on ``hosts`` (a launcher's `Hosts`; None = this machine), with the actor
    classes in ``actors`` instead of the standard ones (or run in the processes of ``session``, a
    `MeshSession`), train for `trainer.steps` (continuing from the last checkpoint when
    ``resume``), evaluate, checkpoint, and write metrics and curves."""
    from tqdm import tqdm

    from meshrl.controller.checkpoints import CheckpointManager
    from meshrl.metrics.curves import plot_curves
    from meshrl.metrics.records import MetricsLogger, read_metrics
    from meshrl.controller.run_records import RunRecords
    from meshrl.controller.runtime import Runtime
    from meshrl.meshes.supervisor import LearnerLost

    t_start = time.perf_counter()
    tc = cfg.trainer
    checkpoints = CheckpointManager(run_dir / "checkpoints", tc.checkpoint.keep)
    start = checkpoints.latest() if resume else None
    if resume and start is None and (run_dir / "metrics.jsonl").exists():
        log.warning("no complete checkpoint in %s: starting the run over", run_dir)
    metrics = MetricsLogger(run_dir, cfg.output.tensorboard, cfg.output.wandb_project, run_dir.name,
                            cfg.model_dump(mode="json"))
    metrics.truncate_after(start.step if start else 0)
    result: dict = {"steps": 0, "evals": [], "faults": 0}
    data_files = None
    try:
        with Runtime(cfg, hosts, actors, session) as rt:
            loop = rt.loop
            data_files = RunRecords(run_dir, loop)
            data_files.truncate_after(start.step if start else 0)
            if start is not None:
                rt.restore_learner(start, respawn=False)  # fresh meshes: load, republish, resync
                log.info("resumed %s from step %d", run_dir, start.step)

            def run_eval(step: int) -> None:
                record = {"kind": "eval", "step": step, "version": loop.version, **loop.evaluate()}
                metrics.log(record)
                result["evals"].append(record)
                log.info("eval at step %d: accuracy %.3f", step, record["eval/accuracy"])

            def save(step: int) -> None:
                tmp = checkpoints.begin(step)
                rt.learner_call("save_checkpoint", str(tmp / "learner"))
                checkpoints.commit(tmp, step, {"loop": loop.state_dict()})

            step = start.step if start else 0
            if step == 0 and tc.eval.at_start:
                run_eval(0)
            bar = tqdm(total=tc.steps, initial=step, desc="train", disable=not tc.progress, dynamic_ncols=True)
            while step < tc.steps:
                try:
                    record, trained = loop.step()
                except LearnerLost as e:
                    recovered_at = time.perf_counter()
                    rt.supervisor.charge(LEARNER, e.cause)
                    back_to = checkpoints.latest()
                    rt.restore_learner(back_to)
                    failed_step, step = step + 1, back_to.step if back_to else 0
                    metrics.truncate_after(step)
                    data_files.truncate_after(step)
                    metrics.log({"kind": "fault", "step": failed_step, "resumed_from_step": step, "mesh": e.mesh,
                                 "cause": e.cause, "action": "learner resumed from checkpoint",
                                 "recovery_s": time.perf_counter() - recovered_at})
                    result["faults"] += 1
                    _log_recoveries(metrics, rt, failed_step, result)  # e.g. the host the learner lost
                    bar.n = step
                    continue
                step += 1
                _log_recoveries(metrics, rt, step, result)
                data_files.write_step(step, trained)
                record.update(kind="train", step=step, elapsed_s=time.perf_counter() - t_start)
                metrics.log(record)
                result["steps"] = step
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.2f}", step_s=f"{record['timing/step_s']:.1f}")
                if tc.eval.every and step % tc.eval.every == 0 and step != tc.steps:
                    run_eval(step)
                if (tc.checkpoint.every and step % tc.checkpoint.every == 0) or step == tc.steps:
                    save(step)
            bar.close()
            if tc.eval.every or tc.eval.at_start:
                run_eval(tc.steps)
            if tc.checkpoint.export_final:
                result["export"] = rt.learner_call("export", str(run_dir / "final_model"))
    finally:
        metrics.close()
        if data_files is not None:
            data_files.close(result["steps"])
    records = read_metrics(metrics.path)
    plot_curves(records, run_dir / "curves.png", title=f"{cfg.task.kind}: {cfg.model.name_or_path}")
    train = [r for r in records if r.get("kind") == "train"]
    result["mean_step_s"] = sum(r["timing/step_s"] for r in train) / max(len(train), 1)
    result["wall_s"] = time.perf_counter() - t_start
    return result


def _log_recoveries(metrics, rt, step: int, result: dict) -> None:
    """One `fault` record per host found lost and per mesh replacement the supervisor made
    during the step."""
    for source, events in (("hosts", rt.hosts.events), ("meshes", rt.supervisor.events)):
        seen = result.setdefault(f"_{source}_logged", 0)
        for event in events[seen:]:
            record = {"kind": "fault", "step": step, **event}
            if source == "hosts":
                record["action"] = "host lost: its meshes move to the surviving hosts"
            metrics.log(record)
            result["faults"] += 1
        result[f"_{source}_logged"] = len(events)


def summary_text(result: dict, run_dir: Path) -> str:
    evals = result.get("evals", [])
    lines = [f"run directory: {run_dir}",
             f"steps: {result['steps']}, mean step {result.get('mean_step_s', 0):.1f}s, wall {result.get('wall_s', 0):.0f}s"
             + (f", recovered from {result['faults']} failure(s)" if result.get("faults") else "")]
    if evals:
        lines.append("held-out accuracy: " + " -> ".join(f"{e['eval/accuracy']:.1%} (step {e['step']})" for e in evals))
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}; curves: {run_dir / 'curves.png'}; "
                 f"dashboard and summary: meshrl report {run_dir}")
    if result.get("export"):
        lines.append(f"final policy (HF format): {result['export']}")
    return "\n".join(lines)
