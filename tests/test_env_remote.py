"""The environment in its own process (HTTP and WebSocket), and the OpenEnv adapters."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, ConfigDict, Field

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.envs.openenv_adapter import OpenEnvAdapter, openenv_available, openenv_types, to_openenv
from meshrl.envs.remote import (
    RemoteEnv,
    RemoteEnvError,
    create_app,
    deserialize_observation,
    serialize_observation,
    spawn_server,
)

GOOD = "```python\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n```"
WRONG = "```python\ndef clamp(x, lo, hi):\n    return x\n```"


@pytest.fixture(scope="module")
def server():
    srv = spawn_server(
        "meshrl.envs.code_env:make_code_env",
        {"env": {"split": "test", "code": {"max_turns": 2}}, "task_ids": ["meshrl/clamp", "meshrl/digit_sum"]},
    )
    yield srv
    srv.close()


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_remote_episode(server, transport):
    env = server.client(transport)
    try:
        assert env.health()
        obs = env.reset(task_id="meshrl/clamp", episode_id=f"remote-{transport}")
        assert "def clamp(" in obs.text and obs.reward == 0.0 and not obs.done
        o1 = env.step(TextAction(text=WRONG))
        assert o1.error_kind == "test_failure" and o1.hint_template_key == "code.test_failure" and not o1.done
        o2 = env.step(GOOD)
        assert o2.done and o2.reward == pytest.approx(1.6) and o2.metadata["termination"] == "success"
        assert o2.message == {"role": "user", "content": o2.text}
        st = env.state
        assert st.episode_id == f"remote-{transport}" and st.step_count == 2
        assert env.state_at(1)[-1] == {"role": "user", "content": o1.text}
        tr = env.trajectory()
        assert tr["success"] and len(tr["turns"]) == 2 and tr["layer"] in ("bwrap", "rlimit")
    finally:
        env.close()


def test_remote_runs_in_another_process(server):
    env = server.client("http")
    try:
        obs = env.reset(task_id="meshrl/clamp")
        code = "```python\nimport os\nprint('pid', os.getpid())\ndef clamp(x, lo, hi):\n    return x\n```"
        env.step(code)
        assert server.proc.pid != os.getpid() and server.proc.poll() is None
        assert obs.metadata["task_id"] == "meshrl/clamp"
    finally:
        env.close()


def test_sessions_are_independent(server):
    a, b = server.client("http"), server.client("http")
    try:
        a.reset(task_id="meshrl/clamp")
        b.reset(task_id="meshrl/digit_sum")
        assert a.session_id != b.session_id
        assert a.step(GOOD).done
        assert b.state.step_count == 0 and b.state.model_extra["task_id"] == "meshrl/digit_sum"
    finally:
        a.close()
        b.close()


def test_remote_errors(server):
    env = server.client("http")
    try:
        with pytest.raises(RemoteEnvError, match="404"):
            env.step("x")  # no session yet
        env.reset(task_id="meshrl/clamp")
        with pytest.raises(RemoteEnvError, match="422"):
            env.step({"bogus": 1})
        with pytest.raises(RemoteEnvError, match="422"):
            env.reset(task_id="meshrl/unknown")
    finally:
        env.close()
    ws = server.client("ws")
    try:
        with pytest.raises(RemoteEnvError, match="reset first"):
            ws.step("x")
    finally:
        ws.close()


def test_observation_wire_format_matches_openenv():
    obs = Observation(text="hi", reward=0.5, done=True, metadata={"a": 1}, error_kind="timeout")
    wire = serialize_observation(obs)
    assert set(wire) == {"observation", "reward", "done", "metadata"}
    assert "reward" not in wire["observation"] and wire["observation"]["text"] == "hi"
    assert deserialize_observation(wire) == obs


class _Counter(Environment):
    def __init__(self):
        self.n = 0
        self.closed = False

    def reset(self, seed=None, episode_id=None, **kw):
        self.n = 0
        return Observation(text="start")

    def step(self, action, timeout_s=None, **kw):
        self.n += 1
        return Observation(text=f"{action.text}:{self.n}", reward=float(self.n), done=self.n >= 3)

    @property
    def state(self):
        return State(episode_id="c", step_count=self.n)

    def close(self):
        self.closed = True


def test_in_process_app_and_session_eviction():
    from fastapi.testclient import TestClient

    made = []

    def factory():
        made.append(_Counter())
        return made[-1]

    app = create_app(factory, max_sessions=2)
    c = TestClient(app)
    assert c.get("/health").json() == {"status": "healthy"}
    assert "text" in c.get("/schema").json()["action"]["properties"]
    sids = [c.post("/reset", json={}).json()["session_id"] for _ in range(3)]
    assert made[0].closed and not made[2].closed  # the oldest session was evicted and closed
    r = c.post("/step", json={"session_id": sids[2], "action": {"text": "go"}}).json()
    assert r["observation"]["text"] == "go:1" and r["reward"] == 1.0
    with c.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {}})
        assert ws.receive_json()["data"]["observation"]["text"] == "start"
        ws.send_json({"type": "step", "data": {"action": {"text": "w"}}})
        assert ws.receive_json()["data"]["observation"]["text"] == "w:1"
        ws.send_json({"type": "state"})
        assert ws.receive_json()["data"]["step_count"] == 1
        ws.send_json({"type": "state_at", "data": {"t": 0}})
        assert ws.receive_json()["type"] == "error"  # _Counter keeps no history
        ws.send_json({"type": "close"})
        assert ws.receive_json()["type"] == "closed"


# ----------------------------------------------------------------------------- OpenEnv adapters


class _OEAction(BaseModel):  # OpenEnv-style types, without needing the package
    model_config = ConfigDict(extra="forbid")
    metadata: dict = Field(default_factory=dict)
    message: str


class _OEObservation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    done: bool = False
    reward: float | None = None
    metadata: dict = Field(default_factory=dict)
    echoed: str = ""
    length: int = 0


class _OEState(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: str | None = None
    step_count: int = 0


class _EchoEnv:
    """Shaped like an OpenEnv Environment[_OEAction, _OEObservation, _OEState]."""

    def __init__(self):
        self._state = _OEState()
        self.closed = False

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = _OEState(episode_id=episode_id or "echo", step_count=0)
        return _OEObservation(echoed="ready")

    def step(self, action: _OEAction, timeout_s=None, **kwargs) -> _OEObservation:
        self._state.step_count += 1
        return _OEObservation(echoed=action.message.upper(), length=len(action.message), reward=1.0,
                              done=self._state.step_count >= 2, metadata={"n": self._state.step_count})

    @property
    def state(self):
        return self._state

    def close(self):
        self.closed = True


def test_openenv_adapter_drives_an_openenv_style_env():
    env = OpenEnvAdapter(_EchoEnv(), action_cls=_OEAction)
    assert env.action_field == "message"
    obs = env.reset(episode_id="e1")
    assert obs.text == "ready" and not obs.done
    o = env.step(TextAction(text="hello"))
    assert o.text == "HELLO" and o.reward == 1.0 and o.metadata["n"] == 1
    assert o.metadata["openenv_observation"]["length"] == 5
    o = env.step(TextAction(text="", metadata={"openenv_action": {"message": "raw"}}))
    assert o.text == "RAW" and o.done
    assert env.state.episode_id == "e1" and env.state.step_count == 2
    env.close()
    assert env.env.closed


def test_openenv_adapter_infers_the_action_type():
    env = OpenEnvAdapter(_EchoEnv())  # from step()'s annotation
    assert env.action_cls is _OEAction


@pytest.mark.skipif(not openenv_available(), reason="optional package openenv-core is not installed")
def test_code_env_served_by_openenv():  # pragma: no cover - needs the optional package
    from fastapi.testclient import TestClient
    from openenv.core.env_server.http_server import create_fastapi_app

    from meshrl.envs.code_env import make_code_env

    act, obs_cls, _ = openenv_types()
    app = create_fastapi_app(lambda: to_openenv(make_code_env({}, task_ids=["meshrl/clamp"])), act, obs_cls)
    c = TestClient(app)
    r = c.post("/reset", json={}).json()
    assert "def clamp(" in r["observation"]["text"]
    with c.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {}})
        assert ws.receive_json()["type"] == "observation"
        ws.send_json({"type": "step", "data": {"text": GOOD}})
        r = ws.receive_json()["data"]
        assert r["done"] and r["reward"] == pytest.approx(1.6)
        assert r["observation"]["text"] == "All 5 hidden tests passed."
