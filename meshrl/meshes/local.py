"""Process-wide settings every actor process must share, set in the controller before anything
imports `monarch`: Monarch reads its supervision timing from the environment when it is first
imported, and spawned processes (and host workers) inherit the controller's environment, which is
how per-run settings (vLLM CPU knobs, offline HF) reach actors."""

from __future__ import annotations

import logging
import os
import re
import sys

from meshrl.config.launch import LaunchConfig
from meshrl.config.meshes import MeshesConfig

log = logging.getLogger("meshrl")

POLL = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"
HOST_IDLE = "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE"
_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


def _milliseconds(duration: str) -> int:
    """Whole milliseconds in a Monarch duration (``500ms``, ``1m``, ``1s 234ms``): what
    `_duration` of a setting keeps of it, so the two compare exactly."""
    return round(sum(float(n) * _UNITS[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)\b", duration)))


def _kept(key: str, seconds: float, variable: str, value: str) -> None:
    log.warning("%s = %s s reaches only the processes started from now on: this one imported Monarch with "
                "%s = %s", key, seconds, variable, value)


def prepare_environment(meshes: MeshesConfig, launch: LaunchConfig | None = None) -> None:
    """Set the supervision knobs (process poll period; with ``launch``, how long a silent host
    lasts before it counts as lost) over any value the environment had: the config decides. In a
    process that imported Monarch already, the host-loss timeout goes through Monarch's runtime
    configuration, which holds unless that import read another value from the environment; the
    poll period has no runtime setting. A knob this process keeps at another value is logged: it
    reaches the processes started from now on. Also offline Hugging Face defaults."""
    imported = "monarch" in sys.modules
    before = os.environ.get(POLL)
    os.environ[POLL] = _duration(meshes.supervision_poll_s)
    if imported and (before is None or _milliseconds(before) != _milliseconds(os.environ[POLL])):
        _kept("meshes.supervision_poll_s", meshes.supervision_poll_s, POLL, before or "Monarch's default")
    if launch is not None:
        os.environ[HOST_IDLE] = _duration(launch.host_loss_timeout_s)
        if imported:
            from monarch.config import configure, get_global_config

            configure(get_proc_state_max_idle=os.environ[HOST_IDLE])
            held = get_global_config()["get_proc_state_max_idle"]
            if _milliseconds(held) != _milliseconds(os.environ[HOST_IDLE]):
                _kept("launch.host_loss_timeout_s", launch.host_loss_timeout_s, HOST_IDLE, held)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
