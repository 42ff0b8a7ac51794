"""An environment written against OpenEnv's interface only (openenv-core's `Environment`, `Action`,
`Observation` and `State`): "What is a + b?" with a second attempt after a wrong answer, reward 1
for a correct first answer and 0.5 for a correct second one. A wrong answer is an error site for
meshrl's SDPO channel (the observation's `error_kind` and `hint_template_key` fields, which meshrl's
OpenEnv client reads). `configs/env-openenv.yaml` trains on it through `meshrl train`, served by
openenv-core's own server over its WebSocket protocol; on its own:

    PYTHONPATH=examples python -m meshrl.envs.openenv_adapter --factory openenv_arithmetic:RetryArithmeticEnv
"""

from __future__ import annotations

import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from meshrl.config.task import ArithmeticConfig
from meshrl.envs.arithmetic import ArithmeticTask, extract_last_integer


class AnswerAction(Action):
    message: str = Field(description="the agent's reply")


class QuestionObservation(Observation):
    prompt: str = Field(default="", description="the question, then the feedback on each answer")
    attempts_left: int = 0
    error_kind: str | None = Field(default=None, description="wrong_answer or wrong_format after a wrong reply")
    hint_template_key: str | None = Field(default=None, description="the SDPO hint template that fits the error")
    hint: str | None = Field(default=None, description="the hint for meshrl's SDPO channel after a wrong reply")


class RetryArithmeticEnv(Environment[AnswerAction, QuestionObservation, State]):
    """One addition per episode, two attempts: `reset(seed=i)` is the i-th training problem,
    `reset(seed=i, split="test")` the i-th held-out one (never among the training problems)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    ATTEMPTS = 2

    def __init__(self):
        super().__init__()
        self.task = ArithmeticTask(ArithmeticConfig())
        self.problem = None
        self._state = State()

    def reset(self, seed=None, episode_id=None, split="train", **kwargs) -> QuestionObservation:
        if split == "test":
            held = self.task.heldout()
            self.problem = held[(seed or 0) % len(held)]
        elif split == "train":
            self.problem = self.task.train_batch(seed or 0, 1)[0]
        else:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return QuestionObservation(prompt=self.problem.messages[-1]["content"], attempts_left=self.ATTEMPTS, reward=0.0)

    def step(self, action: AnswerAction, timeout_s=None, **kwargs) -> QuestionObservation:
        if self.problem is None or self._state.step_count >= self.ATTEMPTS:
            raise RuntimeError("call reset() first: no episode is running")
        self._state.step_count += 1
        left = self.ATTEMPTS - self._state.step_count
        if self.task.grade(self.problem, action.message)[0] > 0:
            return QuestionObservation(prompt="Correct.", reward=1.0 / self._state.step_count, done=True,
                                       attempts_left=left)
        got = extract_last_integer(action.message)
        kind = "wrong_format" if got is None else "wrong_answer"
        feedback = "That is not right. Reply with the number only." if left else f"No: it is {self.problem.answer}."
        hint = f"Hint: {got} is not right." if got is not None else "Hint: reply with a plain number."
        return QuestionObservation(prompt=feedback, reward=0.0, done=left == 0, attempts_left=left, error_kind=kind,
                                   hint_template_key=f"math.{kind}", hint=f"{hint} The correct answer is {self.problem.answer}.")

    @property
    def state(self) -> State:
        return self._state
