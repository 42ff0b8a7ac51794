"""Configuration of `task.kind: env`: training on an environment of the user's own, in one of three
forms, with its training episodes and a disjoint held-out set.

- a Python class or factory (`factory`, with `kwargs`) instantiated in the env mesh's processes: a
  meshrl `Environment`, or an OpenEnv `Environment` (wrapped by meshrl's OpenEnv adapter);
- an OpenEnv server: a running one (`url`, `protocol: openenv`), or the `factory` served by
  openenv-core's own server in a process meshrl starts, health-checks and stops (`serve: true`);
- a meshrl remote environment server (`protocol: meshrl`, meshrl.envs.remote), running or served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section
from meshrl.config.judge import JudgeConfig


class EpisodeSetConfig(Section):
    """Which episodes a set holds: a range of seeds passed to `reset(seed=...)`, or a JSONL file whose
    every line is an object of keyword arguments for `reset` (an episode spec)."""

    seeds: list[int] | None = None
    """`[first, stop)`: episode i is `reset(seed=i)`; ignored when `file` is set."""

    file: str | None = None
    """A JSONL file of episode specs (one JSON object per line, passed to `reset` as keyword
    arguments; a relative path is taken from the working directory)."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments added to every seed's `reset` (e.g. `{split: test}` for held-out problems);
    ignored when `file` is set."""

    limit: int | None = Field(None, ge=1)
    """Use at most this many episodes of the set (the first ones)."""

    @model_validator(mode="after")
    def _check(self) -> "EpisodeSetConfig":
        if self.file is None:
            if self.seeds is None or len(self.seeds) != 2 or self.seeds[0] >= self.seeds[1]:
                raise ValueError(f"seeds must be [first, stop) with first < stop, got {self.seeds}")
        return self


class MCPToolsConfig(Section):
    """An MCP server whose tools the agent may call (fastmcp's client; `pip install fastmcp`)."""

    url: str | None = None
    """A streamable-HTTP MCP server (e.g. `http://127.0.0.1:8765/mcp`): one the user runs, or the one
    `command` starts."""

    command: list[str] = []
    """A server meshrl starts in each env process and restarts when it dies: over stdio (without
    `url`), or an HTTP server listening at `url` (e.g. `[python, examples/calculator_mcp_server.py]`)."""

    env: dict[str, str] = {}
    """Environment variables added for `command`."""

    start_timeout_s: float = Field(60.0, gt=0)
    """Limit of starting (or reaching) the server and listing its tools."""

    @model_validator(mode="after")
    def _check(self) -> "MCPToolsConfig":
        if self.url is None and not self.command:
            raise ValueError("set url (a streamable-HTTP MCP server) or command (a server meshrl starts)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self


class ToolsConfig(Section):
    """Tools the agent may call (OpenAI function schemas), on top of the environment's own
    (`Environment.tools()`): a turn with tool calls gets the results back as tool turns, the turn
    without one is the agent's answer to the environment (meshrl.envs.tools)."""

    functions: list[str] = []
    """Python callables `package.module:function` (imported after `task.env.python_path`); each
    one's schema comes from its signature and docstring unless `schemas` gives it."""

    schemas: dict[str, dict[str, Any]] = {}
    """Explicit OpenAI-format schemas by function name (`{type: function, function: {name,
    description, parameters}}`), replacing the derived ones."""

    mcp: MCPToolsConfig | None = None
    """An MCP server providing tools; None = none."""

    format: Literal["chatml", "llama3"] = "chatml"
    """How tools are shown and calls are written: the model family's format (the renderer's name,
    checked against the model's chat template at start): `chatml` = Qwen2.5's `<tool_call>` JSON,
    `llama3` = Llama 3.1's JSON calls and `ipython` results."""

    call_timeout_s: float = Field(10.0, gt=0)
    """Deadline of one tool call; past it the tool turn says the call timed out (`tools/timed_out`)."""

    max_calls_per_turn: int = Field(4, ge=1)
    """A turn with more calls is a `wrong_format` error (none of them runs)."""

    max_result_chars: int = Field(4000, ge=1)
    """A tool result longer than this is cut (and says so)."""

    system_prompt: str = "You are a helpful assistant."
    """The system prompt the tool list is added to when the environment's first turn is not a
    system message."""


class EnvTaskConfig(Section):
    """An environment of your own: where it comes from, its episodes, and the rules meshrl applies to
    what it returns."""

    factory: str | None = None
    """`package.module:Name`: a class or callable returning an environment (a meshrl `Environment`
    or an OpenEnv `Environment`), called with `kwargs` once per episode. Needed unless `url` is set."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments of `factory`."""

    url: str | None = None
    """A running environment server (`protocol` says which kind); None = use `factory`."""

    serve: bool = False
    """Serve `factory` in a server process of the env mesh's own (`protocol` says which server),
    health-checked at start and restarted when it dies; the episodes then go over the wire."""

    protocol: Literal["openenv", "meshrl"] = "openenv"
    """Wire protocol of `url` or of the served `factory`: openenv-core's server and its WebSocket
    client, or meshrl's remote environment server (meshrl.envs.remote)."""

    python_path: list[str] = []
    """Directories put in front of the import path (and the served process's PYTHONPATH) before
    `factory` is imported, e.g. `[examples]`; relative paths are taken from the working directory."""

    name: str | None = None
    """The environment's name in log lines and errors; None = `factory`'s name or `url`."""

    train: EpisodeSetConfig = EpisodeSetConfig(seeds=[0, 100000])
    """The training episodes (a seeded stream over them, ordered by `trainer.seed`)."""

    heldout: EpisodeSetConfig = EpisodeSetConfig(seeds=[1000000, 1000200])
    """The held-out episodes the evaluation plays; must not share an episode with `train`."""

    max_turns: int = Field(8, ge=1)
    """An episode the environment has not ended after this many policy turns ends (termination
    `max_turns`)."""

    success_reward: float | None = None
    """An episode is a success when its last observation says so (`metadata['success']`), else when
    its return reaches this value; None = a return above 0."""

    hints: dict[str, str] = {}
    """SDPO hint templates of this environment by `hint_template_key`; they take precedence over
    `sdpo.hints` (the environment's own `metadata['hint']` over both)."""

    reset_timeout_s: float = Field(60.0, gt=0)
    """Limit of one `reset`; past it the episode is failed (counted)."""

    step_timeout_s: float = Field(60.0, gt=0)
    """Limit of one `step`; past it the episode is failed (counted)."""

    max_observation_chars: int = Field(16000, ge=1)
    """An observation whose text is longer fails its episode (counted, one log line naming the
    environment and the field)."""

    reward_deadline_s: float = Field(30.0, ge=0)
    """An episode that ends with reward None (the reward comes later) is polled for its `state`'s
    `reward` until this deadline; it is then dropped from its group (counted)."""

    max_parallel: int = Field(16, ge=1, le=256)
    """Episodes one env process steps at once (threads)."""

    server_start_timeout_s: float = Field(120.0, gt=0)
    """Limit of starting a served environment server (`serve: true`) until it answers its health check."""

    tools: ToolsConfig | None = None
    """Tools the agent may call during an episode (Python callables, an MCP server); None = only the
    environment's own (`Environment.tools()`), if any."""

    judge: JudgeConfig | None = None
    """An LLM judge that grades every episode at its end (its transcript and last answer) and whose
    score is mixed into the episode's return (`judge.weight`); None = the environment's rewards only."""

    @model_validator(mode="after")
    def _check(self) -> "EnvTaskConfig":
        if self.url is None and self.factory is None:
            raise ValueError("set factory (an environment class) or url (a running environment server)")
        if self.url is not None and self.serve:
            raise ValueError("serve starts a server for factory: it cannot be combined with url")
        if self.factory is not None and ":" not in self.factory:
            raise ValueError(f"factory must look like 'package.module:Name', got {self.factory!r}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self

    @property
    def label(self) -> str:
        """How log lines and errors name the environment."""
        return self.name or self.factory or self.url or "env"
