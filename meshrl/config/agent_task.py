"""Configuration of `task.kind: agent`: black-box agent programs that play episodes through an
OpenAI-compatible `/v1/chat/completions` endpoint meshrl serves from the generator mesh during
rollouts (meshrl.agents, meshrl.controller.agents)."""

from __future__ import annotations

from pydantic import Field, model_validator

from meshrl.config.base import Section
from meshrl.config.env_task import EpisodeSetConfig


class AgentTaskConfig(Section):
    """An agent program of your own, the episodes it plays, and the limits meshrl holds it to."""

    command: list[str] | None = None
    """The program as a subprocess, one per episode, e.g. `[python, examples/agent_program.py]`: it
    gets `OPENAI_BASE_URL` and `OPENAI_API_KEY` (the episode's own key), the episode spec as JSON on
    stdin (and in `MESHRL_EPISODE` when at most 32 KiB), and prints its result as the last line of its
    output (a JSON number, the reward, or an object with `reward` and optionally `success`). A first
    word `python` is the interpreter meshrl runs under. Set this or `callable`."""

    callable: str | None = None
    """`package.module:fn`, called once per episode in a thread of the controller as
    `fn(client, episode)` with an `openai.OpenAI` client bound to the episode's key and the episode spec
    (a dict); it returns the result (as for `command`). Set this or `command`."""

    python_path: list[str] = []
    """Directories put in front of the import path (for `callable`, `grader`) and of the program's
    `PYTHONPATH`, e.g. `[examples]`; relative paths are taken from the working directory."""

    name: str | None = None
    """The agent's name in log lines and errors; None = `callable` or the command's last word."""

    train: EpisodeSetConfig = EpisodeSetConfig(seeds=[0, 100000])
    """The training episodes (a seeded stream over them, ordered by `trainer.seed`)."""

    heldout: EpisodeSetConfig = EpisodeSetConfig(seeds=[1000000, 1000200])
    """The held-out episodes the evaluation plays; must not share an episode with `train`."""

    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one episode's program run: past it a subprocess's process group is killed (a
    callable's thread is abandoned and its key refused), and the episode is dropped (`agents/timed_out`)."""

    max_completions: int = Field(16, ge=1)
    """Completions one episode may ask for; later requests get HTTP 429 (counted in `agents/rejected`)."""

    max_parallel: int = Field(16, ge=1, le=256)
    """Episodes whose programs run at once."""

    grader: str | None = None
    """`package.module:fn(episode, transcript) -> float`: the episode's reward from the episode spec and
    its transcript (`calls`: the messages, reply and tool calls of every completion served, `result`:
    what the program returned); None = the program's own result is the reward."""

    success_reward: float | None = None
    """An episode is a success when its result says so (`success`), else when its reward reaches this
    value; None = a reward above 0."""

    @model_validator(mode="after")
    def _check(self) -> "AgentTaskConfig":
        if (self.command is None) == (self.callable is None):
            raise ValueError("set exactly one of command (a program run per episode) and callable (module:fn)")
        if self.command is not None and not self.command:
            raise ValueError("command is empty: give the program and its arguments")
        for key, value in (("callable", self.callable), ("grader", self.grader)):
            if value is not None and ":" not in value:
                raise ValueError(f"{key} must look like 'package.module:fn', got {value!r}")
        return self

    @property
    def label(self) -> str:
        """How log lines and errors name the agent."""
        return self.name or self.callable or self.command[-1]
