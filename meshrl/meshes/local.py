"""Local launching: the controller's own machine provides every mesh.

Monarch reads its supervision timing from the environment when it is first imported, so
`prepare_environment` must run before anything imports `monarch`. Spawned processes inherit the
controller's environment, which is how per-run settings (vLLM CPU knobs, offline HF) reach actors.
"""

from __future__ import annotations

import os
import socket

from meshrl.config.meshes import MeshesConfig


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


def prepare_environment(meshes: MeshesConfig) -> None:
    """Set the process-wide knobs every actor process must share (before importing monarch)."""
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", _duration(meshes.supervision_poll_s))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def local_host():
    """The HostMesh of this machine."""
    from monarch.actor import this_host

    return this_host()


def free_port() -> int:
    """A TCP port that is free on this host now (the rendezvous of the learner's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
