"""Where a run's environments come from: one `EnvSource` per env process makes a fresh environment for
every episode.

- `CodeEnvSource`: the built-in code task (a `CodeEnv` per task over one shared sandbox);
- `FactorySource`: `task.env.factory` instantiated in this process (an OpenEnv environment is wrapped
  by `OpenEnvAdapter`);
- `ServerSource`: an environment server, a running one (`task.env.url`) or the factory served in a
  child process this source starts, health-checks and restarts when it has died; episodes go over
  OpenEnv's WebSocket client or meshrl's remote client (`task.env.protocol`).

`check_env_source` is the controller's check of a config before anything is spawned: the factory's
module and name import, the URL answers its health check, a judge's server answers. Its errors are one line.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.config.base import ConfigError
from meshrl.config.env import EnvConfig
from meshrl.config.env_task import EnvTaskConfig
from meshrl.envs.base import Environment

log = logging.getLogger(__name__)


class EnvSourceError(ConfigError):
    """A `task.env` that cannot work: one line naming the key and what is wrong."""


@dataclass(frozen=True)
class EpisodeRules:
    """What the env process enforces on every episode, whatever the environment."""

    label: str
    max_turns: int
    reset_timeout_s: float
    step_timeout_s: float
    max_observation_chars: int
    reward_deadline_s: float
    success_reward: float | None
    max_parallel: int
    default_error_kind: str | None
    """The error kind of a failed turn whose observation names none (None: the turn is no error site)."""


def _add_python_path(paths: list[str]) -> None:
    for p in reversed(paths):
        p = os.path.abspath(p)
        if p not in sys.path:
            sys.path.insert(0, p)


def import_callable(spec: str, key: str, python_path: list[str], what: str = "function",
                    error: type[ConfigError] = EnvSourceError) -> Callable[..., Any]:
    """``package.module:name`` (the config's ``key``) imported after ``python_path``: the callable,
    or ``error`` naming ``key`` in one line (also when the module raises as it is imported)."""
    _add_python_path(python_path)
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure, in one line
        raise error(f"{key}: cannot import module '{module}' ({type(e).__name__}: {e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise error(f"{key}: module '{module}' has no {what} '{name}'")
    return fn


def import_factory(cfg: EnvTaskConfig) -> Callable[..., Any]:
    """`task.env.factory` imported (after `task.env.python_path`); EnvSourceError in one line."""
    return import_callable(cfg.factory, "task.env.factory", cfg.python_path, "class or function")


def _healthy(url: str, timeout_s: float) -> str | None:
    """None when ``url``'s `/health` answers 200, else why not (one line)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None if r.status_code == 200 else f"/health answered {r.status_code}"


def _reachable(url: str, timeout_s: float) -> str | None:
    """None when a server answers at ``url`` (any HTTP status), else why not (one line)."""
    import httpx

    try:
        httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_env_source(cfg: EnvTaskConfig, timeout_s: float = 10.0) -> None:
    """Fail before anything spawns: the factory imports, or the URL's server answers; the judge's
    server answers."""
    if cfg.factory is not None:
        import_factory(cfg)
    if cfg.url is not None:
        why = _healthy(cfg.url, timeout_s)
        if why is not None:
            raise EnvSourceError(f"task.env.url: no environment server answers at {cfg.url} ({why})")
    if cfg.judge is not None:
        url = cfg.judge.endpoint.base_url
        why = _reachable(f"{url}/models", timeout_s)
        if why is not None:
            raise EnvSourceError(f"task.env.judge.endpoint.base_url: no judge server answers at {url} ({why})")


def adapt(env: Any, label: str) -> Environment:
    """A meshrl environment as it is, an OpenEnv one through `OpenEnvAdapter`."""
    if isinstance(env, Environment):
        return env
    if callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None)):
        from meshrl.envs.openenv_adapter import OpenEnvAdapter

        return OpenEnvAdapter(env)
    raise TypeError(f"env {label}: the factory returned a {type(env).__name__}, not an environment")


class CodeEnvSource:
    """The built-in code task: a `CodeEnv` per task over this process's one sandbox."""

    def __init__(self, cfg: EnvConfig):
        from meshrl.envs.sandbox import Sandbox

        self.cfg = cfg
        self.sandbox = Sandbox(cfg.sandbox)
        code = cfg.code
        self.rules = EpisodeRules("code", code.max_turns, 60.0, 2 * code.exec_timeout_s + 30.0, 1 << 20, 0.0, None,
                                  cfg.sandbox.max_parallel, "test_failure")

    def describe(self) -> dict:
        return {"layer": self.sandbox.layer}

    def open(self, spec) -> tuple[Environment, dict]:
        from meshrl.envs.code_env import CodeEnv

        return CodeEnv(spec, self.sandbox, self.cfg.code), {}

    def recover(self) -> bool:
        return False

    def close(self) -> None:
        self.sandbox.close()


def _rules(cfg: EnvTaskConfig) -> EpisodeRules:
    return EpisodeRules(cfg.label, cfg.max_turns, cfg.reset_timeout_s, cfg.step_timeout_s, cfg.max_observation_chars,
                        cfg.reward_deadline_s, cfg.success_reward, cfg.max_parallel, None)


class FactorySource:
    """`task.env.factory(**kwargs)` in this process, one environment per episode."""

    def __init__(self, cfg: EnvTaskConfig):
        self.cfg, self.rules = cfg, _rules(cfg)
        self.factory = import_factory(cfg)
        self.tools = EnvTools(cfg)

    @property
    def counts(self):
        return self.tools.counts

    def describe(self) -> dict:
        return {"env": self.cfg.label, "form": "class", **self.tools.describe()}

    def open(self, spec) -> tuple[Environment, dict]:
        return self.tools.wrap(adapt(self.factory(**self.cfg.kwargs), self.cfg.label)), dict(spec.kwargs)

    def recover(self) -> bool:
        return self.tools.recover()

    def close(self) -> None:
        self.tools.close()


class ServerSource:
    """Episodes on an environment server over the wire: `task.env.url`, or `task.env.factory` served in
    a child process (restarted by `recover` when it has died). The server gets SIGTERM when the
    thread that started it ends (Linux's parent-death signal): the actor's own thread starts and
    restarts it, never a worker thread, so it lives exactly as long as the env process."""

    def __init__(self, cfg: EnvTaskConfig):
        self.cfg, self.rules = cfg, _rules(cfg)
        self.tools = EnvTools(cfg)
        self.server = None
        self._lock = threading.Lock()
        self._action_field: str | None = None
        self.url = cfg.url
        if cfg.serve:
            import_factory(cfg)  # one line now, not a server that never starts
            self._start()

    def _start(self) -> None:
        from meshrl.envs.remote import spawn_server

        env = dict(os.environ)
        paths = [os.path.abspath(p) for p in self.cfg.python_path]
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in sys.path if p])
        args: list[str] = []
        module = "meshrl.envs.remote"
        if self.cfg.protocol == "openenv":
            module, args = "meshrl.envs.openenv_adapter", ["--max-sessions", str(OPENENV_SESSIONS)]
        try:
            self.server = spawn_server(self.cfg.factory, self.cfg.kwargs, timeout_s=self.cfg.server_start_timeout_s,
                                       env=env, module=module, args=args)
        except RuntimeError as e:
            raise EnvSourceError(f"env {self.cfg.label}: {e}") from None
        why = _healthy(self.server.url, self.cfg.server_start_timeout_s)
        if why is not None:
            self.server.close()
            raise EnvSourceError(f"env {self.cfg.label}: the served environment fails its health check ({why})")
        self.url = self.server.url

    def describe(self) -> dict:
        return {"env": self.cfg.label, "form": "served" if self.cfg.serve else "url", "protocol": self.cfg.protocol,
                "url": self.url, "server_pid": self.server.proc.pid if self.server is not None else None,
                **self.tools.describe()}

    @property
    def counts(self):
        return self.tools.counts

    def open(self, spec) -> tuple[Environment, dict]:
        if self.cfg.protocol == "meshrl":
            from meshrl.envs.remote import RemoteEnv

            return self.tools.wrap(RemoteEnv(self.url, transport="ws", timeout_s=self.cfg.step_timeout_s)), dict(spec.kwargs)
        from meshrl.envs.openenv_adapter import OpenEnvClient

        client = OpenEnvClient(self.url, action_field=self._action_field, connect_timeout_s=self.cfg.reset_timeout_s,
                               message_timeout_s=self.cfg.step_timeout_s)
        self._action_field = client.action_field
        return self.tools.wrap(client), dict(spec.kwargs)

    def recover(self) -> bool:
        """Restart the served server when its process has died, and the tools' server when it is
        gone; True if either was restarted."""
        tools = self.tools.recover()
        return self._recover_server() or tools

    def _recover_server(self) -> bool:
        with self._lock:
            if self.server is None or self.server.proc.poll() is None:
                return False
            log.warning("env %s: the environment server (pid %d) died with %s; restarting it", self.cfg.label,
                        self.server.proc.pid, self.server.proc.returncode)
            self._start()
            return True

    def close(self) -> None:
        self.tools.close()
        if self.server is not None:
            self.server.close()


class EnvTools:
    """The tools of an env process (`task.env.tools`: callables, an MCP server) and their counters;
    `wrap` gives an environment them (and its own `tools()`) through `ToolEnv`."""

    def __init__(self, cfg: EnvTaskConfig):
        from collections import Counter

        from meshrl.config.env_task import ToolsConfig
        from meshrl.envs.tools import FunctionTools, MCPTools, ToolBox, ToolRules

        self.cfg, self.counts, self.mcp = cfg, Counter(), None
        tcfg = cfg.tools or ToolsConfig()
        providers = []
        if tcfg.functions or tcfg.schemas:
            try:
                providers.append(FunctionTools([import_callable(f, "task.env.tools.functions", cfg.python_path)
                                               for f in tcfg.functions], tcfg.schemas))
            except (TypeError, ValueError) as e:
                raise EnvSourceError(f"task.env.tools: {e}") from None
        if tcfg.mcp is not None:
            m = tcfg.mcp
            try:
                self.mcp = MCPTools(m.url, m.command or None, m.env, m.start_timeout_s, label=f"env {cfg.label} mcp")
            except RuntimeError as e:
                raise EnvSourceError(f"task.env.tools.mcp: {e}") from None
            providers.append(self.mcp)
        rules = ToolRules(tcfg.format, tcfg.call_timeout_s, tcfg.max_calls_per_turn, tcfg.max_result_chars,
                          tcfg.system_prompt)
        try:
            self.box = ToolBox(providers, rules, self.counts)
        except ValueError as e:
            raise EnvSourceError(f"task.env.tools: {e}") from None

    def describe(self) -> dict:
        if not self.box.by_name:
            return {}
        return {"tools": sorted(self.box.by_name), "mcp_pid": self.mcp.pid if self.mcp is not None else None}

    def wrap(self, env: Environment) -> Environment:
        """``env`` with the configured tools and its own (`ToolEnv`), or as it is when there are none."""
        own = env.tools() if isinstance(env, Environment) else []
        if not own and not self.box.by_name:
            return env
        from meshrl.envs.tools import FunctionTools, ToolEnv

        callables = [t for t in own if not hasattr(t, "schemas")]
        providers = [t for t in own if hasattr(t, "schemas")] + ([FunctionTools(callables)] if callables else [])
        return ToolEnv(env, self.box.with_providers(providers))

    def recover(self) -> bool:
        """Restart the MCP server when it is gone (counted `tools/mcp_restarts`)."""
        if self.mcp is None or not self.mcp.recover():
            return False
        self.counts["tools/mcp_restarts"] += 1
        return True

    def close(self) -> None:
        if self.mcp is not None:
            self.mcp.close()


#: sessions an OpenEnv server started by meshrl accepts at once (one per live episode)
OPENENV_SESSIONS = 1024


def env_source(spec: EnvConfig | EnvTaskConfig):
    """The source of a run's environments: the code task's, or `task.env`'s form."""
    if isinstance(spec, EnvConfig):
        return CodeEnvSource(spec)
    if spec.url is not None or spec.serve:
        return ServerSource(spec)
    return FactorySource(spec)
