"""The environment in its own process (HTTP and WebSocket), and the OpenEnv adapters."""

from __future__ import annotations

import os

import pytest

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.envs.openenv_adapter import (
    METADATA_FIELD,
    OpenEnvAdapter,
    OpenEnvClient,
    openenv_app,
    openenv_types,
    spawn_openenv_server,
)
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
    """OpenEnv's own serialisation, plus the metadata OpenEnv's drops (meshrl's server keeps it)."""
    from openenv.core.env_server.serialization import serialize_observation as openenv_serialize

    obs = Observation(text="hi", reward=0.5, done=True, metadata={"a": 1}, error_kind="timeout")
    wire = serialize_observation(obs)
    _, obs_cls, _ = openenv_types()
    theirs = openenv_serialize(obs_cls(text="hi", reward=0.5, done=True, metadata={"a": 1}, error_kind="timeout"))
    assert set(wire) == set(theirs) | {"metadata"}
    assert {k: wire[k] for k in ("reward", "done")} == {k: theirs[k] for k in ("reward", "done")}
    assert {k: v for k, v in theirs["observation"].items() if k != METADATA_FIELD} == wire["observation"]
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


# ----------------------------------------------------------------------------- OpenEnv (openenv-core 0.3.0)

from openenv.core.env_server.interfaces import Environment as OEnvironment  # noqa: E402
from openenv.core.env_server.types import Action as OAction  # noqa: E402
from openenv.core.env_server.types import Observation as OObservation  # noqa: E402
from openenv.core.env_server.types import State as OState  # noqa: E402


class EchoAction(OAction):
    message: str


class EchoObservation(OObservation):
    echoed: str = ""
    length: int = 0


class EchoEnv(OEnvironment[EchoAction, EchoObservation, OState]):
    """An environment written against OpenEnv's interface: upper-cases the message, ends after two."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = OState()
        self.closed = False

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = OState(episode_id=episode_id or "echo", step_count=0)
        return EchoObservation(echoed="ready")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return EchoObservation(echoed=action.message.upper(), length=len(action.message), reward=1.0,
                               done=self._state.step_count >= 2, metadata={"n": self._state.step_count})

    @property
    def state(self):
        return self._state

    def close(self):
        self.closed = True


def test_openenv_adapter_drives_an_openenv_environment():
    env = OpenEnvAdapter(EchoEnv())
    assert env.action_cls is EchoAction and env.action_field == "message"
    obs = env.reset(episode_id="e1")
    assert obs.text == "ready" and not obs.done
    o = env.step(TextAction(text="hello"))
    assert o.text == "HELLO" and o.reward == 1.0 and o.metadata["n"] == 1
    assert o.metadata["openenv_observation"] == {"echoed": "HELLO", "length": 5}
    o = env.step(TextAction(text="", metadata={"openenv_action": {"message": "raw"}}))
    assert o.text == "RAW" and o.done
    assert env.state.episode_id == "e1" and env.state.step_count == 2
    env.close()
    assert env.env.closed


def test_openenv_adapter_reads_the_action_type_from_step_annotations():
    class Plain:  # no generic base: the type comes from step's annotation
        def step(self, action: EchoAction, timeout_s=None) -> EchoObservation: ...

    assert OpenEnvAdapter(Plain()).action_cls is EchoAction
    with pytest.raises(TypeError, match="cannot tell the action type"):
        OpenEnvAdapter(object())


def test_code_env_served_by_openenv():
    """meshrl's CodeEnv behind openenv-core's own app: schema, one-step HTTP, a WebSocket episode."""
    from fastapi.testclient import TestClient

    from meshrl.envs.code_env import make_code_env

    app = openenv_app(lambda: make_code_env({}, task_ids=["meshrl/clamp"]), max_sessions=2)
    c = TestClient(app)
    assert c.get("/health").json()["status"] == "healthy"
    schema = c.get("/schema").json()
    assert schema["action"]["properties"]["text"]["type"] == "string" and "meshrl_metadata" in schema["observation"]["properties"]
    r = c.post("/reset", json={}).json()  # OpenEnv's HTTP reset: a fresh environment, closed after the call
    assert "def clamp(" in r["observation"]["text"] and r["done"] is False and "metadata" not in r
    with c.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"episode_id": "ws-1"}})
        assert ws.receive_json()["type"] == "observation"
        ws.send_json({"type": "step", "data": {"text": WRONG}})
        r = ws.receive_json()["data"]
        assert not r["done"] and r["observation"]["error_kind"] == "test_failure"
        assert r["observation"]["meshrl_metadata"]["episode_id"] == "ws-1"
        ws.send_json({"type": "step", "data": {"text": GOOD}})
        r = ws.receive_json()["data"]
        assert r["done"] and r["reward"] == pytest.approx(1.6)
        assert r["observation"]["text"] == "All 5 hidden tests passed."
        assert r["observation"]["meshrl_metadata"]["termination"] == "success"
        ws.send_json({"type": "state"})
        assert ws.receive_json()["data"]["step_count"] == 2
        ws.send_json({"type": "step", "data": {"bogus": 1}})
        assert ws.receive_json()["type"] == "error"  # OpenEnv validates against the action type


def test_openenv_app_serves_an_openenv_environment_with_its_declared_types():
    from fastapi.testclient import TestClient

    c = TestClient(openenv_app(EchoEnv, max_sessions=2))
    assert set(c.get("/schema").json()["action"]["properties"]) == {"message", "metadata"}
    with c.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {}})
        ws.receive_json()
        ws.send_json({"type": "step", "data": {"message": "abc"}})
        assert ws.receive_json()["data"] == {"observation": {"echoed": "ABC", "length": 3}, "reward": 1.0, "done": False}
    with pytest.raises(TypeError, match="declares no action/observation types"):
        openenv_app(lambda: type("Untyped", (), {"close": lambda self: None})())


@pytest.fixture(scope="module")
def openenv_server():
    srv = spawn_openenv_server("meshrl.envs.code_env:make_code_env",
                               {"env": {"split": "test", "code": {"max_turns": 2}}, "task_ids": ["meshrl/clamp"]},
                               max_sessions=2)
    yield srv
    srv.close()


def test_openenv_client_plays_an_episode_on_openenvs_server_in_another_process(openenv_server):
    env = OpenEnvClient(openenv_server.url)  # OpenEnv's WebSocket client, the text field from /schema
    try:
        assert env.action_field == "text"
        obs = env.reset(episode_id="oe-1")
        assert "def clamp(" in obs.text and not obs.done and obs.metadata["task_id"] == "meshrl/clamp"
        o1 = env.step(WRONG)
        assert o1.error_kind == "test_failure" and o1.hint_template_key == "code.test_failure" and not o1.done
        o2 = env.step(TextAction(text=GOOD))
        assert o2.done and o2.reward == pytest.approx(1.6) and o2.metadata["termination"] == "success"
        assert o2.message == {"role": "user", "content": "All 5 hidden tests passed."}
        assert env.state.episode_id == "oe-1" and env.state.step_count == 2
        with pytest.raises(ValueError, match="carries the action only"):
            env.step(GOOD, timeout_s=1.0)
        with pytest.raises(RemoteEnvError, match="episode is over"):
            env.step(GOOD)  # the environment's own error, from the server
    finally:
        env.close()
    assert openenv_server.proc.poll() is None and openenv_server.proc.pid != os.getpid()
    with pytest.raises(RemoteEnvError, match="closed"):
        env.reset()


def test_openenv_client_errors_name_the_server():
    with pytest.raises(RemoteEnvError, match=r"127\.0\.0\.1:9/schema"):
        OpenEnvClient("http://127.0.0.1:9", connect_timeout_s=2.0)  # nothing listens on port 9
