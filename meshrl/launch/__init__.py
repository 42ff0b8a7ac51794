"""Launching a run on hosts from Monarch's job launchers: this machine (`local`), local host
workers (`process`), SLURM (`slurm`) and Kubernetes (`k8s`)."""

from __future__ import annotations

from pathlib import Path

from meshrl.config.launch import LaunchConfig
from meshrl.launch.base import Launcher, LaunchError


def make_launcher(cfg: LaunchConfig, run_id: str, run_dir: Path | None = None) -> Launcher:
    """The launcher `cfg.launcher` names."""
    if cfg.launcher == "local":
        from meshrl.launch.local import LocalLauncher as cls
    elif cfg.launcher == "process":
        from meshrl.launch.process import ProcessLauncher as cls
    elif cfg.launcher == "slurm":
        from meshrl.launch.slurm import SlurmLauncher as cls
    else:
        from meshrl.launch.k8s import K8sLauncher as cls
    return cls(cfg, run_id, run_dir)


__all__ = ["LaunchError", "Launcher", "make_launcher"]
