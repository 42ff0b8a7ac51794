"""The environment contract, shaped like OpenEnv's so either side can host the other.

An environment has ``reset(seed=None, episode_id=None) -> Observation``, ``step(action) ->
Observation``, a ``state`` property and ``close()``. Actions, observations and state are pydantic
models whose base fields match OpenEnv's (``Action.metadata``; ``Observation.done / reward /
metadata``; ``State.episode_id / step_count``), so they serialise to the same JSON.

meshrl's environments deal in chat text: the observation carries the text of the next user/tool
turn, and ``message`` is that turn as a chat dict the runtime appends (token-in/token-out stays the
runtime's job; environments never re-render history). Step results also carry error-site markers
for the SDPO channel: ``error_kind`` (what went wrong, see ``ERROR_KINDS``) and
``hint_template_key`` (which hint template fits it).
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: error kinds an environment step (or a sandbox execution) may report, and what each means
ERROR_KINDS: dict[str, str] = {
    "syntax_error": "the code does not compile",
    "import_error": "an import failed (no such module inside the sandbox)",
    "runtime_error": "an exception was raised while running the code",
    "test_failure": "the code ran but returned wrong answers for some tests",
    "missing_entry_point": "the code ran but did not define the requested function",
    "timeout": "the wall-clock or CPU limit was hit",
    "memory_error": "the memory limit was hit",
    "resource_limit": "a process, open-file, file-size or disk limit was hit",
    "output_limit": "the program printed more than the output cap",
    "permission_denied": "the code tried to touch something read-only or forbidden",
    "file_not_found": "the code opened a path that does not exist inside the sandbox",
    "network_error": "the code tried to use the network, which the sandbox does not have",
    "crash": "the process died from a signal (segfault, abort)",
    "wrong_format": "no code could be found in the reply",
    "tool_not_found": "the reply called a tool (or program) that does not exist",
    "sandbox_error": "the sandbox itself failed to run the code",
    "grading_anomaly": "the code tampered with grading (forged replies, exited early, printed fake reports); graded 0",
}


class Action(BaseModel):
    """Base of every action (OpenEnv-compatible: unknown fields rejected, ``metadata`` free-form)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    metadata: dict[str, Any] = Field(default_factory=dict)


class TextAction(Action):
    """A model reply: the text the policy generated for this turn."""

    text: str = ""


class Observation(BaseModel):
    """Base of every observation: OpenEnv's ``done / reward / metadata`` plus meshrl's text turn and
    error-site markers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    done: bool = False
    reward: float | None = 0.0
    metadata: dict[str, Any] = Field(default_factory=dict)
    text: str = ""
    """Content of the next turn shown to the agent (the task at reset, feedback after a step)."""
    role: str = "user"
    """Role of that turn in the chat."""
    error_kind: str | None = None
    """What went wrong in this step (a key of ``ERROR_KINDS``), or None."""
    hint_template_key: str | None = None
    """Key of the hint template that fits the error (for the SDPO channel), or None."""

    @property
    def message(self) -> dict[str, str]:
        """The turn as a chat message for the runtime to append."""
        return {"role": self.role, "content": self.text}


class State(BaseModel):
    """Episode state (OpenEnv-compatible: extra fields allowed)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    episode_id: str | None = None
    step_count: int = Field(default=0, ge=0)


class Environment(abc.ABC):
    """The contract every meshrl environment implements (OpenEnv's, plus history access)."""

    #: one instance may serve several sessions at once (OpenEnv's flag of the same name)
    SUPPORTS_CONCURRENT_SESSIONS: bool = False

    @abc.abstractmethod
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        """Start an episode and return the first observation (reward 0, not done)."""

    @abc.abstractmethod
    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """Apply the agent's action; the observation carries reward, done and error markers."""

    @property
    @abc.abstractmethod
    def state(self) -> State:
        """The current episode state."""

    def state_at(self, t: int) -> list[dict[str, str]]:
        """The exact message list the agent saw before its action at step ``t`` (for teacher
        replay). Environments without chat history raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} keeps no message history")

    def tools(self) -> list:
        """Tools this environment offers its agent: Python callables (their signature and docstring
        give the schema) or tool providers (meshrl.envs.tools); [] = none. With tools, every turn
        with tool calls is answered with their results and only the turn without one reaches `step`."""
        return []

    def trajectory(self) -> dict[str, Any]:
        """A JSON-serialisable record of the episode so far."""
        st = self.state
        return st.model_dump(mode="json")

    def close(self) -> None:
        """Release resources; the environment may not be used afterwards."""

    async def reset_async(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        """``reset`` in a worker thread, so an event loop is never blocked."""
        return await asyncio.to_thread(self.reset, seed, episode_id, **kwargs)

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """``step`` in a worker thread (sandboxed execution blocks), so the generator keeps going."""
        return await asyncio.to_thread(self.step, action, timeout_s, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
