"""An environment written against OpenEnv's interface only (openenv-core's `Environment`, `Action`,
`Observation` and `State`): "What is a + b?" with a second attempt after a wrong answer, reward 1
for a correct first answer and 0.5 for a correct second one. examples/openenv_rl.py serves it with
openenv-core's own server and trains on it; on its own:

    PYTHONPATH=examples python -m meshrl.envs.openenv_adapter --factory openenv_arithmetic:RetryArithmeticEnv
"""

from __future__ import annotations

import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from meshrl.config.task import ArithmeticConfig
from meshrl.envs.arithmetic import ArithmeticTask


class AnswerAction(Action):
    message: str = Field(description="the agent's reply")


class QuestionObservation(Observation):
    prompt: str = Field(default="", description="the question, then the feedback on each answer")
    attempts_left: int = 0


class RetryArithmeticEnv(Environment[AnswerAction, QuestionObservation, State]):
    """One addition per episode (`reset(seed=i)`: the i-th training problem), two attempts."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    ATTEMPTS = 2

    def __init__(self):
        super().__init__()
        self.task = ArithmeticTask(ArithmeticConfig())
        self.problem = None
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> QuestionObservation:
        self.problem = self.task.train_batch(seed or 0, 1)[0]
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
        feedback = "That is not right. Reply with the number only." if left else f"No: it is {self.problem.answer}."
        return QuestionObservation(prompt=feedback, reward=0.0, done=left == 0, attempts_left=left)

    @property
    def state(self) -> State:
        return self._state
