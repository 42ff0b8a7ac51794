"""`meshrl launch {local,process,slurm,k8s}` and `meshrl train`: the same training run on hosts
from the launcher the `launch:` section names, with the job killed on every way out (a normal end,
an error, Ctrl-C, SIGTERM; after a SIGKILL of the controller the process launcher's reaper does it)."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Iterator

from meshrl.config.base import to_yaml
from meshrl.config.run import RunConfig
from meshrl.launch import LaunchError, make_launcher


def run_id_for(cfg: RunConfig, run_dir: Path | None) -> str:
    """`launch.run_id`, else the run directory's name, else `output.name`, else the task."""
    if cfg.launch.run_id:
        return cfg.launch.run_id
    name = run_dir.name if run_dir is not None else (cfg.output.name or cfg.task.kind)
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower())[:40] or "meshrl"


@contextlib.contextmanager
def launched_hosts(cfg: RunConfig, run_dir: Path) -> Iterator:
    """Start the job `cfg.launch` describes and yield its `Hosts`; kill the job on leaving,
    also when the controller receives SIGTERM."""
    from meshrl.meshes.local import prepare_environment

    prepare_environment(cfg.meshes, cfg.launch)  # before the workers start: they inherit it
    launcher = make_launcher(cfg.launch, run_id_for(cfg, run_dir), run_dir)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield launcher.start()
    finally:
        launcher.stop()
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`, which kills the job


def launch_main(cfg: RunConfig, resume: str | None = None, overwrite: bool = False) -> int:
    """Train under ``cfg``'s launcher; returns the exit code."""
    from meshrl.controller.train import train_main

    try:
        return train_main(cfg, resume=resume, overwrite=overwrite, hosts_for=launched_hosts)
    except LaunchError as e:
        print(f"meshrl: {e}", file=sys.stderr)
        return 1


def dry_run_text(cfg: RunConfig, source: str, placement_header: str, placement_table: str,
                 out_dir: Path | None) -> str:
    """The resolved config, the placement and what the launcher would submit (batch script,
    manifests written under ``out_dir``), without starting anything."""
    run_dir = Path(cfg.output.dir) / (cfg.output.name or "RUN_NAME")  # where a real run would write
    launcher = make_launcher(cfg.launch, run_id_for(cfg, run_dir if cfg.output.name else None), run_dir)
    lines = [f"# resolved from {source}", to_yaml(cfg).rstrip("\n")]
    lines += [f"# {line}" for line in placement_header.splitlines()]
    lines += [f"# {line}" for line in placement_table.splitlines()]
    lines += [f"# {line}".rstrip() for line in launcher.dry_run(out_dir).splitlines()]  # the output stays YAML
    return "\n".join(lines) + "\n"
