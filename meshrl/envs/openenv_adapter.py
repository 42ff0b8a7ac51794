"""Bridges to OpenEnv (``openenv-core`` 0.3.0, installed with the ``dev`` extra; nothing here imports
it until a function below needs it).

* ``OpenEnvAdapter(env)`` runs an OpenEnv ``Environment`` in-process behind meshrl's contract: the
  policy's text goes into the environment's action type, the observation's text field comes back as
  the next turn (reward, done and metadata carried over).
* ``OpenEnvClient(url)`` does the same for an environment served by OpenEnv's server (any: a
  Hugging Face Space's, or ``openenv_app``'s below), driven through OpenEnv's own WebSocket client
  (``openenv.core.GenericEnvClient``), one server session per client.
* ``to_openenv(env)`` goes the other way: a meshrl environment as an OpenEnv ``Environment`` whose
  action/observation types are ``openenv_types()``.
* ``openenv_app(factory)`` is OpenEnv's own FastAPI app (``openenv.core.env_server.create_app``)
  serving one environment per session, a meshrl one through ``to_openenv`` or an OpenEnv one as it
  is; ``python -m meshrl.envs.openenv_adapter --factory package.module:callable`` serves it in a
  process (``spawn_openenv_server``).

OpenEnv's wire format sends an observation's own fields, ``reward`` and ``done``, and drops its
``metadata``: ``to_openenv``'s observations therefore also carry meshrl's metadata in a field of
their own, ``meshrl_metadata``, which ``OpenEnvClient`` puts back. OpenEnv's HTTP ``/reset`` and
``/step`` make a fresh environment per request (one-step use); episodes of several turns go over its
``/ws`` endpoint, which ``OpenEnvClient`` uses.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import typing
from typing import Any, Callable

from meshrl.envs.base import Action, Environment, Observation, State, TextAction
from meshrl.envs.remote import RemoteEnvError, ServerProcess, load_factory, serve_app, spawn_server

#: observation fields tried, in order, for the text of the next turn
TEXT_FIELDS = ("text", "prompt", "message", "content", "output", "stdout", "observation", "feedback")
#: action fields tried, in order, for where the policy's text goes
ACTION_FIELDS = ("text", "message", "content", "code", "command", "action", "response", "answer")
#: the observation field of ``to_openenv``'s observations that carries meshrl's metadata over the wire
METADATA_FIELD = "meshrl_metadata"


def _declared_types(env: Any) -> tuple[type | None, type | None]:
    """(action, observation) types an OpenEnv environment declares: the parameters of its
    ``Environment[ActT, ObsT, StateT]`` base, else the annotations of its ``step``."""
    for klass in type(env).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                return args[0], args[1]
    try:
        hints = typing.get_type_hints(type(env).step)
    except Exception:  # noqa: BLE001 -- unresolvable annotations: nothing declared
        return None, None
    act, obs = hints.get("action"), hints.get("return")
    return (act if isinstance(act, type) else None), (obs if isinstance(obs, type) else None)


def _text_field_of(string_fields: list[str]) -> str | None:
    """Where the text goes in an action with these string fields: the first of ``ACTION_FIELDS``,
    else the only one."""
    found = next((f for f in ACTION_FIELDS if f in string_fields), None)
    if found is None and len(string_fields) == 1:
        found = string_fields[0]
    return found


class _TextTurns:
    """The text side of both bridges: an OpenEnv observation as meshrl's turn, and the policy's
    text as an OpenEnv action's fields."""

    text_field: str | None
    action_field: str | None
    role: str

    def _observation(self, fields: dict[str, Any], reward: Any, done: Any, metadata: dict[str, Any]) -> Observation:
        """meshrl's Observation from an OpenEnv observation: its own ``fields`` (without reward,
        done and metadata, as OpenEnv serialises it), ``reward``, ``done`` and ``metadata``."""
        fields = dict(fields)
        meta = {**metadata, **(fields.pop(METADATA_FIELD, None) or {})}
        field = self.text_field or next((f for f in TEXT_FIELDS if isinstance(fields.get(f), str)), None)
        if field is None:
            strings = [f for f, v in fields.items() if isinstance(v, str)]
            field = strings[0] if len(strings) == 1 else None
        text = fields.get(field) if field else json.dumps(fields, default=str)
        meta["openenv_observation"] = fields
        if isinstance(fields.get("hint"), str):  # an SDPO hint sent as a field (the wire drops metadata)
            meta.setdefault("hint", fields["hint"])
        error_kind, hint_key = fields.get("error_kind"), fields.get("hint_template_key")
        return Observation(
            text=str(text),
            role=str(fields.get("role") or self.role),
            reward=None if reward is None else float(reward),
            done=bool(done),
            metadata=meta,
            error_kind=error_kind if isinstance(error_kind, str) else None,
            hint_template_key=hint_key if isinstance(hint_key, str) else None,
        )

    def _action_fields(self, action: Any, action_name: str) -> dict[str, Any]:
        """The OpenEnv action's fields for ``action``: a dict as it is, ``metadata['openenv_action']``
        of a meshrl action when set, else the action's text in the text field."""
        if isinstance(action, dict):
            return action
        if isinstance(action, str):
            action = TextAction(text=action)
        if not isinstance(action, Action):
            raise TypeError(f"cannot turn {type(action).__name__} into {action_name}")
        raw = action.metadata.get("openenv_action")
        if isinstance(raw, dict):
            return raw
        if self.action_field is None:
            raise TypeError(f"{action_name} has no text field; pass action_field= or metadata['openenv_action']")
        return {self.action_field: getattr(action, "text", "")}


class OpenEnvAdapter(_TextTurns, Environment):
    """An OpenEnv environment in this process, driven with text through meshrl's contract."""

    def __init__(self, env: Any, action_cls: type | None = None, text_field: str | None = None,
                 action_field: str | None = None, role: str = "user"):
        self.env = env
        self.action_cls = action_cls or _declared_types(env)[0]
        if self.action_cls is None:
            raise TypeError(f"cannot tell the action type of {type(env).__name__}; pass action_cls=")
        fields = getattr(self.action_cls, "model_fields", {})
        self.action_field = action_field or _text_field_of(
            [f for f, info in fields.items() if f != "metadata" and info.annotation is str])
        self.text_field = text_field
        self.role = role

    def _to_observation(self, obs: Any) -> Observation:
        fields = obs.model_dump(mode="json", exclude={"reward", "done", "metadata"})
        return self._observation(fields, getattr(obs, "reward", None), getattr(obs, "done", False),
                                 dict(getattr(obs, "metadata", None) or {}))

    def _to_action(self, action: Any) -> Any:
        if isinstance(action, self.action_cls):
            return action
        return self.action_cls.model_validate(self._action_fields(action, self.action_cls.__name__))

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
        return State.model_validate(st.model_dump(mode="json") if hasattr(st, "model_dump") else dict(st))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


@functools.lru_cache(maxsize=1)
def _generic_client_class() -> type:
    """OpenEnv's ``GenericEnvClient``, leaving a session as its server expects: after the ``close``
    message the client waits for the server to close the connection. (0.3.0's client closes its end
    at once; the server's own close then fails and uvicorn logs a WebSocketDisconnect traceback, for
    about half of the sessions.)"""
    from openenv.core.generic_client import GenericEnvClient

    class Client(GenericEnvClient):
        async def disconnect(self) -> None:
            if self._ws is None:
                return
            try:
                await self._send({"type": "close"})
                await asyncio.wait_for(self._ws.wait_closed(), timeout=self._connect_timeout)
            except Exception:  # noqa: BLE001 -- the server may be gone; the connection is closed below regardless
                pass
            await self._ws.close()
            self._ws = None

    return Client


class OpenEnvClient(_TextTurns, Environment):
    """An environment served by OpenEnv's server at ``url``, through OpenEnv's WebSocket client (one
    server session, opened on the first call). The action's text field is read from the server's
    ``/schema`` unless ``action_field`` names it. A reply slower than ``message_timeout_s``, a
    connection not made within ``connect_timeout_s`` or an error reply raises `RemoteEnvError`."""

    def __init__(self, url: str, text_field: str | None = None, action_field: str | None = None, role: str = "user",
                 connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.text_field, self.role = text_field, role
        self.message_timeout_s = message_timeout_s
        self.action_field = action_field or self._action_field_from_schema(connect_timeout_s)
        self._client = _generic_client_class()(self.url, connect_timeout_s=connect_timeout_s,
                                               message_timeout_s=message_timeout_s).sync()

    def _action_field_from_schema(self, timeout_s: float) -> str | None:
        import httpx

        try:
            r = httpx.get(f"{self.url}/schema", timeout=timeout_s)
            r.raise_for_status()
            props = r.json()["action"].get("properties", {})
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise RemoteEnvError(f"{self.url}/schema: {type(e).__name__}: {e}") from None
        return _text_field_of([f for f, p in props.items() if f != "metadata" and p.get("type") == "string"])

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._client is None:
            raise RemoteEnvError(f"{self.url}: {what}: the client is closed")
        try:
            return fn()
        except (TimeoutError, asyncio.TimeoutError):
            self.close()  # a late reply would be read as the answer to the next message
            raise RemoteEnvError(f"{self.url}: no reply to {what} within {self.message_timeout_s}s") from None
        except (ConnectionError, RuntimeError, OSError) as e:
            raise RemoteEnvError(f"{self.url}: {what}: {e}") from None

    def _result(self, result: Any) -> Observation:
        return self._observation(result.observation, result.reward, result.done, {})

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        data = {k: v for k, v in dict(seed=seed, episode_id=episode_id, **kwargs).items() if v is not None}
        return self._result(self._call("reset", lambda: self._client.reset(**data)))

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if timeout_s is not None or kwargs:
            raise ValueError("OpenEnv's WebSocket step carries the action only: no timeout_s or other arguments")
        fields = self._action_fields(action, "the served action")
        return self._result(self._call("step", lambda: self._client.step(fields)))

    @property
    def state(self) -> State:
        return State.model_validate(self._call("state", lambda: self._client.state()))

    def close(self) -> None:
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 -- the server may be gone; the loop thread is stopped regardless
                pass


@functools.lru_cache(maxsize=1)
def openenv_types() -> tuple[type, type, type]:
    """(action, observation, state) classes: OpenEnv's base types with meshrl's text fields."""
    from openenv.core.env_server.types import Action as OAction
    from openenv.core.env_server.types import Observation as OObservation
    from openenv.core.env_server.types import State as OState
    from pydantic import Field

    class MeshrlTextAction(OAction):
        text: str = Field(default="", description="the policy's reply")

    class MeshrlTextObservation(OObservation):
        text: str = Field(default="", description="the next turn shown to the agent")
        role: str = Field(default="user", description="the role of that turn in the chat")
        error_kind: str | None = Field(default=None, description="what went wrong in this step, or None")
        hint_template_key: str | None = Field(default=None, description="the hint template that fits the error")
        meshrl_metadata: dict[str, Any] = Field(default_factory=dict,
                                                description="meshrl's metadata (OpenEnv's wire format drops `metadata`)")

    return MeshrlTextAction, MeshrlTextObservation, OState


def to_openenv(env: Environment):
    """``env`` as an ``openenv.core.env_server.interfaces.Environment`` (types ``openenv_types()``)."""
    from openenv.core.env_server.interfaces import Environment as OEnvironment

    act_cls, obs_cls, state_cls = openenv_types()

    def convert(obs: Observation):
        return obs_cls(text=obs.text, role=obs.role, error_kind=obs.error_kind, hint_template_key=obs.hint_template_key,
                       reward=obs.reward, done=obs.done, metadata=obs.metadata, meshrl_metadata=obs.metadata)

    class MeshrlEnvironment(OEnvironment[act_cls, obs_cls, state_cls]):  # type: ignore[valid-type]
        # every session gets an instance of its own from the server's factory
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.inner = env

        def reset(self, seed=None, episode_id=None, **kwargs):
            return convert(self.inner.reset(seed=seed, episode_id=episode_id, **kwargs))

        def step(self, action, timeout_s=None, **kwargs):
            return convert(self.inner.step(TextAction(text=action.text, metadata=dict(action.metadata)), timeout_s=timeout_s))

        @property
        def state(self):
            return state_cls.model_validate(self.inner.state.model_dump(mode="json"))

        def close(self):
            self.inner.close()

    return MeshrlEnvironment()


def openenv_app(factory: Callable[[], Any], max_sessions: int = 1):
    """OpenEnv's own FastAPI app (``create_app``: ``/ws``, ``/reset``, ``/step``, ``/state``,
    ``/schema``, ``/health``), one environment per session from ``factory``: a meshrl environment is
    served through ``to_openenv``, an OpenEnv one with the types its class declares. ``max_sessions``
    is OpenEnv's ``max_concurrent_envs`` (above 1 only for classes with SUPPORTS_CONCURRENT_SESSIONS)."""
    from openenv.core.env_server import create_app

    probe = factory()
    try:
        if isinstance(probe, Environment):
            act_cls, obs_cls, _ = openenv_types()
            make: Callable[[], Any] = lambda: to_openenv(factory())  # noqa: E731
        else:
            act_cls, obs_cls = _declared_types(probe)
            if act_cls is None or obs_cls is None:
                raise TypeError(f"{type(probe).__name__} declares no action/observation types "
                                "(subclass Environment[ActT, ObsT, StateT])")
            make = factory
    finally:
        probe.close()
    return create_app(make, act_cls, obs_cls, max_concurrent_envs=max_sessions)


def spawn_openenv_server(factory: str, kwargs: dict | None = None, max_sessions: int = 1, host: str = "127.0.0.1",
                         timeout_s: float = 120.0, env: dict[str, str] | None = None) -> ServerProcess:
    """``python -m meshrl.envs.openenv_adapter`` in a child process (``factory`` as
    ``package.module:callable``), waited for until it listens; `ServerProcess.close()` stops it."""
    return spawn_server(factory, kwargs, host, timeout_s, env, module="meshrl.envs.openenv_adapter",
                        args=["--max-sessions", str(max_sessions)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve environments with openenv-core's own server.")
    ap.add_argument("--factory", required=True,
                    help="package.module:callable returning a meshrl or an OpenEnv environment")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-sessions", type=int, default=1, help="OpenEnv's max_concurrent_envs")
    args = ap.parse_args(argv)
    fn = load_factory(args.factory)
    kwargs = json.loads(args.kwargs)
    serve_app(openenv_app(lambda: fn(**kwargs), args.max_sessions), host=args.host, port=args.port)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
