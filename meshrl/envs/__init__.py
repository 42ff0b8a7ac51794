"""Agentic environments: the OpenEnv-shaped contract, the code sandbox, the multi-turn
code-execution environment, task sets, and remote/OpenEnv adapters.

Submodules are imported on first use so that importing one environment stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Action": "meshrl.envs.base",
    "TextAction": "meshrl.envs.base",
    "Observation": "meshrl.envs.base",
    "State": "meshrl.envs.base",
    "Environment": "meshrl.envs.base",
    "ERROR_KINDS": "meshrl.envs.base",
    "Sandbox": "meshrl.envs.sandbox",
    "SandboxJob": "meshrl.envs.sandbox",
    "ExecResult": "meshrl.envs.sandbox",
    "ProbeResult": "meshrl.envs.sandbox",
    "SandboxUnavailable": "meshrl.envs.sandbox",
    "CodeEnv": "meshrl.envs.code_env",
    "CodeAction": "meshrl.envs.code_actions",
    "CodeTask": "meshrl.envs.tasks",
    "TestCase": "meshrl.envs.tasks",
    "load_code_tasks": "meshrl.envs.tasks",
    "load_humaneval": "meshrl.envs.humaneval",
    "EnvConfig": "meshrl.config.env",
    "SandboxConfig": "meshrl.config.env",
    "CodeEnvConfig": "meshrl.config.env",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'meshrl.envs' has no attribute '{name}'")
    return getattr(importlib.import_module(mod), name)
