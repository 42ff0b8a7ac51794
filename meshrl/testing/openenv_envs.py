"""An environment written against OpenEnv's interface (openenv-core) for tests of training on
OpenEnv's server with the random tiny model: every reply gets a reward that varies between samples
(its fraction of vowels), so groups have advantages to train on."""

from __future__ import annotations

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from meshrl.testing.rewards import vowel_fraction


class ReplyAction(Action):
    message: str


class PromptObservation(Observation):
    prompt: str = ""


class VowelEnv(Environment[ReplyAction, PromptObservation, State]):
    """Two turns ("Say something." then "Once more."), each reply rewarded with its vowel fraction."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    TURNS = 2

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> PromptObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return PromptObservation(prompt="Say something.", reward=0.0)

    def step(self, action: ReplyAction, timeout_s=None, **kwargs) -> PromptObservation:
        self._state.step_count += 1
        reward = vowel_fraction(None, action.message)[0]
        return PromptObservation(prompt="Once more.", reward=reward, done=self._state.step_count >= self.TURNS)

    @property
    def state(self) -> State:
        return self._state
