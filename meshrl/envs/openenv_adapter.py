"""Bridges to OpenEnv (``openenv-core``, optional: nothing here imports it unless asked).

* ``OpenEnvAdapter(env)`` runs any OpenEnv ``Environment`` in-process behind meshrl's contract:
  the policy's text goes into the environment's action type, and the observation's text field
  comes back as the next turn (reward, done and metadata carried over).
* ``to_openenv(env)`` goes the other way: a meshrl environment (e.g. ``CodeEnv``) as an OpenEnv
  ``Environment`` whose action/observation types are ``openenv_types()``, so OpenEnv's own server
  (``openenv.core.env_server.create_app``) and clients can host and drive it.

The adapter is duck-typed: it needs only ``reset/step/state/close`` and pydantic models, so it also
works with environments written against OpenEnv's interface without the package installed.
"""

from __future__ import annotations

import functools
import importlib
import json
import typing
from typing import Any

from meshrl.envs.base import Action, Environment, Observation, State, TextAction

#: observation fields tried, in order, for the text of the next turn
TEXT_FIELDS = ("text", "prompt", "message", "content", "output", "stdout", "observation", "feedback")
#: action fields tried, in order, for where the policy's text goes
ACTION_FIELDS = ("text", "message", "content", "code", "command", "action", "response", "answer")


def openenv_available() -> bool:
    """True when the optional ``openenv`` package (openenv-core) imports."""
    try:
        importlib.import_module("openenv.core.env_server.interfaces")
        importlib.import_module("openenv.core.env_server.types")
        return True
    except Exception:  # noqa: BLE001 -- missing, or missing one of its dependencies
        return False


def _action_cls_of(env: Any) -> type | None:
    """The action type an OpenEnv environment declares (``Environment[ActT, ObsT, StateT]`` or the
    annotation of ``step``)."""
    for klass in type(env).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    try:
        hints = typing.get_type_hints(type(env).step)
        a = hints.get("action")
        if isinstance(a, type):
            return a
    except Exception:  # noqa: BLE001
        pass
    return None


class OpenEnvAdapter(Environment):
    """An OpenEnv environment, driven with text through meshrl's contract."""

    def __init__(
        self,
        env: Any,
        action_cls: type | None = None,
        text_field: str | None = None,
        action_field: str | None = None,
        role: str = "user",
    ):
        self.env = env
        self.action_cls = action_cls or _action_cls_of(env)
        if self.action_cls is None:
            raise TypeError(f"cannot tell the action type of {type(env).__name__}; pass action_cls=")
        fields = getattr(self.action_cls, "model_fields", {})
        if action_field is None:
            action_field = next((f for f in ACTION_FIELDS if f in fields), None)
            if action_field is None:
                action_field = next((f for f, info in fields.items() if f != "metadata" and info.annotation is str), None)
        self.action_field = action_field
        self.text_field = text_field
        self.role = role

    def _to_observation(self, obs: Any) -> Observation:
        data = obs.model_dump(mode="json", exclude={"reward", "done", "metadata"}) if hasattr(obs, "model_dump") else dict(obs)
        field = self.text_field or next((f for f in TEXT_FIELDS if isinstance(data.get(f), str)), None)
        if field is None:
            strings = [f for f, v in data.items() if isinstance(v, str)]
            field = strings[0] if len(strings) == 1 else None
        text = data.get(field) if field else json.dumps(data, default=str)
        reward = getattr(obs, "reward", None)
        meta = dict(getattr(obs, "metadata", None) or {})
        meta["openenv_observation"] = data
        return Observation(
            text=str(text),
            role=self.role,
            reward=None if reward is None else float(reward),
            done=bool(getattr(obs, "done", False)),
            metadata=meta,
            error_kind=data.get("error_kind") if isinstance(data.get("error_kind"), str) else None,
            hint_template_key=data.get("hint_template_key") if isinstance(data.get("hint_template_key"), str) else None,
        )

    def _to_action(self, action: Any) -> Any:
        if isinstance(action, self.action_cls):
            return action
        if isinstance(action, dict):
            return self.action_cls.model_validate(action)
        if isinstance(action, str):
            action = TextAction(text=action)
        if isinstance(action, Action):
            raw = action.metadata.get("openenv_action")
            if isinstance(raw, dict):
                return self.action_cls.model_validate(raw)
            if self.action_field is None:
                raise TypeError(f"{self.action_cls.__name__} has no text field; pass metadata['openenv_action']")
            return self.action_cls(**{self.action_field: getattr(action, "text", "")})
        raise TypeError(f"cannot turn {type(action).__name__} into {self.action_cls.__name__}")

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        return self._to_observation(self.env.reset(seed=seed, episode_id=episode_id, **kwargs))

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        act = self._to_action(action)
        if timeout_s is not None:
            return self._to_observation(self.env.step(act, timeout_s=timeout_s, **kwargs))
        return self._to_observation(self.env.step(act, **kwargs))

    @property
    def state(self) -> State:
        st = self.env.state
        data = st.model_dump(mode="json") if hasattr(st, "model_dump") else dict(st)
        return State.model_validate(data)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


@functools.lru_cache(maxsize=1)
def openenv_types() -> tuple[type, type, type]:
    """(action, observation, state) classes: OpenEnv's base types with meshrl's text fields."""
    from openenv.core.env_server.types import Action as OAction
    from openenv.core.env_server.types import Observation as OObservation
    from openenv.core.env_server.types import State as OState

    class MeshrlTextAction(OAction):
        text: str = ""

    class MeshrlTextObservation(OObservation):
        text: str = ""
        role: str = "user"
        error_kind: str | None = None
        hint_template_key: str | None = None

    return MeshrlTextAction, MeshrlTextObservation, OState


def to_openenv(env: Environment):
    """``env`` as an ``openenv.core.env_server.interfaces.Environment`` (needs openenv-core)."""
    from openenv.core.env_server.interfaces import Environment as OEnvironment

    act_cls, obs_cls, state_cls = openenv_types()

    def convert(obs: Observation):
        return obs_cls(
            text=obs.text,
            role=obs.role,
            error_kind=obs.error_kind,
            hint_template_key=obs.hint_template_key,
            reward=obs.reward,
            done=obs.done,
            metadata=obs.metadata,
        )

    class MeshrlEnvironment(OEnvironment[act_cls, obs_cls, state_cls]):  # type: ignore[valid-type]
        SUPPORTS_CONCURRENT_SESSIONS = False

        def __init__(self):
            super().__init__()
            self.inner = env

        def reset(self, seed=None, episode_id=None, **kwargs):
            return convert(self.inner.reset(seed=seed, episode_id=episode_id, **kwargs))

        def step(self, action, timeout_s=None, **kwargs):
            a = TextAction(text=action.text, metadata=dict(action.metadata))
            return convert(self.inner.step(a, timeout_s=timeout_s))

        @property
        def state(self):
            return state_cls.model_validate(self.inner.state.model_dump(mode="json"))

        def close(self):
            self.inner.close()

    return MeshrlEnvironment()
