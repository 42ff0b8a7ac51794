"""meshrl environments for tests of `task.kind: env` with the random tiny model: `VowelChatEnv` rewards
every reply with its vowel fraction (groups have advantages to train on) and marks a reply with few
vowels as an error site; `FaultyEnv` misbehaves on purpose, one way per `mode`, on the episodes whose
seed is odd (the even ones behave), so that a test sees the bad episodes fail alone."""

from __future__ import annotations

import math
import threading
import time

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.testing.rewards import vowel_fraction


class VowelChatEnv(Environment):
    """`turns` turns ("Say something." then "Once more."), each reply rewarded with its vowel
    fraction; a reply under `low` vowels is an error site (`error_kind` `few_vowels`). Keeps no
    history of its own (`state_at` is not implemented): the env host records the turns."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, turns: int = 2, low: float = 0.3):
        self.turns, self.low = turns, low
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0, seed=seed)
        return Observation(text="Say something.")

    def step(self, action: TextAction, timeout_s=None, **kwargs) -> Observation:
        self._state.step_count += 1
        reward = vowel_fraction(None, action.text)[0]
        few = reward < self.low
        return Observation(text="Once more.", reward=reward, done=self._state.step_count >= self.turns,
                           error_kind="few_vowels" if few else None,
                           hint_template_key="vowels.few" if few else None,
                           metadata={"error_text": f"only {reward:.0%} vowels"} if few else {})

    @property
    def state(self) -> State:
        return self._state


class FaultyEnv(Environment):
    """One step per episode; on odd seeds it fails as `mode` says:
    `reset_raises`, `step_raises`, `step_hangs` (sleeps `hang_s`), `huge_text` (an observation of 10**6
    characters), `nan_reward`, `not_observation` (returns a dict), `bad_role` (an `assistant` turn),
    `late_reward` (ends with reward None; `state.reward` becomes 1.0 after `late_s`), `no_reward` (ends
    with reward None for ever)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, mode: str, hang_s: float = 30.0, late_s: float = 0.2):
        self.mode, self.hang_s, self.late_s = mode, hang_s, late_s
        self._state = State()
        self.odd = False
        self.ended_at: float | None = None

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self.odd = bool((seed or 0) % 2)
        if self.odd and self.mode == "reset_raises":
            raise ValueError("the episode database is down")
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(text="Say something.")

    def step(self, action: TextAction, timeout_s=None, **kwargs):
        self._state.step_count += 1
        mode = self.mode if self.odd else "good"
        if mode == "step_raises":
            raise RuntimeError("the simulator crashed")
        if mode == "step_hangs":
            threading.Event().wait(self.hang_s)
        if mode == "not_observation":
            return {"text": "done", "reward": 1.0}
        if mode in ("late_reward", "no_reward"):
            self.ended_at = time.monotonic()
            return Observation(text="Scoring later.", reward=None, done=True)
        reward = {"nan_reward": math.nan}.get(mode, 0.5)
        text = "x" * 10**6 if mode == "huge_text" else "Thanks."
        role = "assistant" if mode == "bad_role" else "user"
        return Observation(text=text, role=role, reward=reward, done=True)

    @property
    def state(self) -> State:
        if self.mode == "late_reward" and self.ended_at is not None and time.monotonic() - self.ended_at >= self.late_s:
            return State(episode_id=self._state.episode_id, step_count=self._state.step_count, reward=1.0)
        return self._state
