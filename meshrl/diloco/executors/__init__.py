"""Executors that run DiLoCo replicas as independent jobs sharing only the object store
(`base.py` has the protocol and how cloud backends would implement it)."""

from meshrl.diloco.executors.base import ExecutorError, ReplicaResult, ReplicaSpec, ReplicaStatus, ServerlessExecutor
from meshrl.diloco.executors.local import LocalProcessExecutor

__all__ = ["ExecutorError", "LocalProcessExecutor", "ReplicaResult", "ReplicaSpec", "ReplicaStatus",
           "ServerlessExecutor"]
