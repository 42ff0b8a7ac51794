"""Process-wide settings every actor process must share, set in the controller before anything
imports `monarch`: Monarch reads its supervision timing from the environment when it is first
imported, and spawned processes (and host workers) inherit the controller's environment, which is
how per-run settings (vLLM CPU knobs, offline HF) reach actors."""

from __future__ import annotations

import os

from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import MeshesConfig


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


def prepare_environment(meshes: MeshesConfig, launch: LaunchConfig | None = None) -> None:
    """Set the supervision knobs (process poll period; with ``launch``, how long a silent host
    lasts before it counts as lost) and offline Hugging Face defaults."""
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", _duration(meshes.supervision_poll_s))
    if launch is not None:
        os.environ.setdefault("HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE", _duration(launch.host_loss_timeout_s))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
