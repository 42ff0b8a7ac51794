"""Run an environment in its own process and talk to it over HTTP or WebSocket.

Server: ``create_app(factory)`` is a FastAPI app; every session (an HTTP ``session_id``, or one
WebSocket connection) gets its own environment from ``factory()``. The wire format follows
OpenEnv's: ``POST /reset {seed, episode_id, ...}`` and ``POST /step {action: {...}, timeout_s}``
answer ``{observation: {...}, reward, done, metadata}`` (plus ``session_id``); ``GET /state``,
``GET /health``, ``GET /schema``; meshrl adds ``GET /state_at?t=``, ``GET /trajectory`` and
``POST /close``. The WebSocket endpoint ``/ws`` takes ``{"type": "reset"|"step"|"state"|
"state_at"|"trajectory"|"close", "data": {...}}`` and answers ``{"type": ..., "data": ...}``.

Process: ``python -m meshrl.envs.remote --factory meshrl.envs.code_env:make_code_env --kwargs
'{"env": {"split": "test"}}' --port 0`` prints ``MESHRL_ENV_SERVER_READY <url>`` once listening;
``spawn_server(...)`` does that from Python and returns the URL.

Client: ``RemoteEnv(url, transport="http"|"ws")`` implements the same ``Environment`` contract.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable

from meshrl.envs.base import Action, Environment, Observation, State, TextAction

READY = "MESHRL_ENV_SERVER_READY"


def serialize_observation(obs: Observation) -> dict[str, Any]:
    """OpenEnv's shape: reward/done/metadata beside the other observation fields."""
    return {
        "observation": obs.model_dump(mode="json", exclude={"reward", "done", "metadata"}),
        "reward": obs.reward,
        "done": obs.done,
        "metadata": obs.model_dump(mode="json", include={"metadata"})["metadata"],
    }


def deserialize_observation(payload: dict[str, Any]) -> Observation:
    fields = dict(payload.get("observation") or {})
    fields.update(reward=payload.get("reward"), done=bool(payload.get("done")), metadata=payload.get("metadata") or {})
    return Observation.model_validate(fields)


def load_factory(spec: str) -> Callable[..., Environment]:
    """``package.module:callable`` -> the callable."""
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise ValueError(f"factory must look like 'package.module:callable', got {spec!r}")
    return getattr(importlib.import_module(mod), name)


class _Sessions:
    """Environments by session id, oldest closed first past ``max_sessions``."""

    def __init__(self, factory: Callable[[], Environment], max_sessions: int):
        self.factory = factory
        self.max = max_sessions
        self.envs: OrderedDict[str, Environment] = OrderedDict()
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def get(self, sid: str | None, create: bool) -> tuple[str, Environment, threading.Lock]:
        with self.lock:
            if sid is not None and sid in self.envs:
                self.envs.move_to_end(sid)
                return sid, self.envs[sid], self.locks[sid]
            if not create:
                raise KeyError(sid)
        env = self.factory()  # outside the lock: may be slow (sandbox probe)
        sid = sid or uuid.uuid4().hex
        evicted = []
        with self.lock:
            self.envs[sid] = env
            self.locks[sid] = threading.Lock()
            while len(self.envs) > self.max:
                old, old_env = self.envs.popitem(last=False)
                self.locks.pop(old, None)
                evicted.append(old_env)
            lk = self.locks[sid]
        for e in evicted:
            e.close()
        return sid, env, lk

    def close(self, sid: str) -> bool:
        with self.lock:
            env = self.envs.pop(sid, None)
            self.locks.pop(sid, None)
        if env is None:
            return False
        env.close()
        return True

    def close_all(self) -> None:
        with self.lock:
            envs = list(self.envs.values())
            self.envs.clear()
            self.locks.clear()
        for e in envs:
            e.close()


def create_app(factory: Callable[[], Environment], action_cls: type[Action] = TextAction, max_sessions: int = 64):
    """The FastAPI app serving environments made by ``factory`` (one per session)."""
    from fastapi import Body, FastAPI, HTTPException, WebSocket, WebSocketDisconnect

    sessions = _Sessions(factory, max_sessions)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        sessions.close_all()

    app = FastAPI(title="meshrl environment server", lifespan=lifespan)
    app.state.sessions = sessions

    def lookup(sid: str | None):
        try:
            return sessions.get(sid, create=False)
        except KeyError:
            raise HTTPException(404, f"unknown session '{sid}' (call /reset first)") from None

    @app.get("/health")
    def health() -> dict:
        return {"status": "healthy"}

    @app.get("/schema")
    def schema() -> dict:
        return {
            "action": action_cls.model_json_schema(),
            "observation": Observation.model_json_schema(),
            "state": State.model_json_schema(),
        }

    @app.post("/reset")
    def reset(body: dict = Body(default={})) -> dict:
        body = dict(body or {})
        sid = body.pop("session_id", None)
        seed = body.pop("seed", None)
        episode_id = body.pop("episode_id", None)
        sid, env, lk = sessions.get(sid, create=True)
        with lk:
            try:
                obs = env.reset(seed=seed, episode_id=episode_id, **body)
            except (TypeError, KeyError, ValueError) as e:
                raise HTTPException(422, f"reset failed: {e}") from None
        return {"session_id": sid, **serialize_observation(obs)}

    @app.post("/step")
    def step(body: dict = Body(...)) -> dict:
        sid, env, lk = lookup(body.get("session_id"))
        try:
            action = action_cls.model_validate(body.get("action") or {})
        except Exception as e:  # noqa: BLE001 -- pydantic validation error
            raise HTTPException(422, f"invalid action: {e}") from None
        with lk:
            try:
                obs = env.step(action, timeout_s=body.get("timeout_s"))
            except RuntimeError as e:
                raise HTTPException(409, str(e)) from None
        return {"session_id": sid, **serialize_observation(obs)}

    @app.get("/state")
    def state(session_id: str) -> dict:
        _, env, _ = lookup(session_id)
        return env.state.model_dump(mode="json")

    @app.get("/state_at")
    def state_at(session_id: str, t: int) -> dict:
        _, env, _ = lookup(session_id)
        try:
            return {"messages": env.state_at(t)}
        except (IndexError, NotImplementedError) as e:
            raise HTTPException(404, f"{type(e).__name__}: {e}") from None

    @app.get("/trajectory")
    def trajectory(session_id: str) -> dict:
        _, env, _ = lookup(session_id)
        return env.trajectory()

    @app.post("/close")
    def close(body: dict = Body(default={})) -> dict:
        return {"closed": sessions.close(str((body or {}).get("session_id")))}

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        env: Environment | None = None
        try:
            while True:
                msg = await websocket.receive_json()
                kind = msg.get("type")
                data = msg.get("data") or {}
                try:
                    if kind == "reset":
                        if env is None:
                            env = await asyncio.to_thread(factory)
                        data = dict(data)
                        seed, eid = data.pop("seed", None), data.pop("episode_id", None)
                        obs = await asyncio.to_thread(env.reset, seed, eid, **data)
                        reply = {"type": "observation", "data": serialize_observation(obs)}
                    elif env is None:
                        reply = {"type": "error", "data": {"message": "call reset first"}}
                    elif kind == "step":
                        action = action_cls.model_validate(data.get("action", data))
                        obs = await asyncio.to_thread(env.step, action, data.get("timeout_s"))
                        reply = {"type": "observation", "data": serialize_observation(obs)}
                    elif kind == "state":
                        reply = {"type": "state", "data": env.state.model_dump(mode="json")}
                    elif kind == "state_at":
                        reply = {"type": "messages", "data": {"messages": env.state_at(int(data["t"]))}}
                    elif kind == "trajectory":
                        reply = {"type": "trajectory", "data": env.trajectory()}
                    elif kind == "close":
                        await websocket.send_json({"type": "closed", "data": {}})
                        break
                    else:
                        reply = {"type": "error", "data": {"message": f"unknown message type {kind!r}"}}
                except Exception as e:  # noqa: BLE001 -- report, keep the connection
                    reply = {"type": "error", "data": {"message": f"{type(e).__name__}: {e}"}}
                await websocket.send_json(reply)
        except WebSocketDisconnect:
            pass
        finally:
            if env is not None:
                await asyncio.to_thread(env.close)

    # this module uses postponed annotations; FastAPI needs the real class to inject the socket
    ws.__annotations__ = {"websocket": WebSocket, "return": None}
    app.add_api_websocket_route("/ws", ws)
    return app


# ----------------------------------------------------------------------------- client


class RemoteEnvError(RuntimeError):
    """The server rejected a request."""


class RemoteEnv(Environment):
    """Client of an environment server; the same contract as a local environment."""

    def __init__(self, url: str, transport: str = "http", timeout_s: float = 300.0):
        if transport not in ("http", "ws"):
            raise ValueError("transport must be 'http' or 'ws'")
        self.url = url.rstrip("/")
        self.transport = transport
        self.timeout_s = timeout_s
        self.session_id: str | None = None
        self._http = None
        self._ws = None
        if transport == "http":
            import httpx

            self._http = httpx.Client(base_url=self.url, timeout=timeout_s)
        else:
            from websockets.sync.client import connect

            ws_url = "ws" + self.url[len("http"):] if self.url.startswith("http") else self.url
            # entered like a context manager (closed in close()): the form every websockets version accepts
            self._ws = connect(ws_url + "/ws", open_timeout=timeout_s, max_size=64 << 20).__enter__()

    # --- plumbing
    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        if r.status_code >= 400:
            raise RemoteEnvError(f"{path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def _get(self, path: str, **params) -> dict:
        r = self._http.get(path, params=params)
        if r.status_code >= 400:
            raise RemoteEnvError(f"{path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def _ws_call(self, kind: str, data: dict | None = None) -> dict:
        self._ws.send(json.dumps({"type": kind, "data": data or {}}))
        reply = json.loads(self._ws.recv(timeout=self.timeout_s))
        if reply.get("type") == "error":
            raise RemoteEnvError(reply["data"].get("message", "error"))
        return reply

    # --- contract
    def health(self) -> bool:
        if self._http is None:
            return True
        return self._get("/health").get("status") == "healthy"

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        body = {"seed": seed, "episode_id": episode_id, **kwargs}
        if self._http is not None:
            if self.session_id:
                body["session_id"] = self.session_id
            payload = self._post("/reset", body)
            self.session_id = payload["session_id"]
            return deserialize_observation(payload)
        return deserialize_observation(self._ws_call("reset", body)["data"])

    def step(self, action: Action | str | dict, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if isinstance(action, str):
            action = TextAction(text=action)
        data = action.model_dump(mode="json") if isinstance(action, Action) else dict(action)
        if self._http is not None:
            payload = self._post("/step", {"session_id": self.session_id, "action": data, "timeout_s": timeout_s})
            return deserialize_observation(payload)
        return deserialize_observation(self._ws_call("step", {"action": data, "timeout_s": timeout_s})["data"])

    @property
    def state(self) -> State:
        if self._http is not None:
            return State.model_validate(self._get("/state", session_id=self.session_id))
        return State.model_validate(self._ws_call("state")["data"])

    def state_at(self, t: int) -> list[dict[str, str]]:
        try:
            if self._http is not None:
                return self._get("/state_at", session_id=self.session_id, t=t)["messages"]
            return self._ws_call("state_at", {"t": t})["data"]["messages"]
        except RemoteEnvError as e:  # the served environment keeps no history: as a local one says it
            if "NotImplementedError:" in str(e):
                raise NotImplementedError(str(e)) from None
            raise

    def trajectory(self) -> dict[str, Any]:
        if self._http is not None:
            return self._get("/trajectory", session_id=self.session_id)
        return self._ws_call("trajectory")["data"]

    def close(self) -> None:
        if self._http is not None:
            try:
                if self.session_id:
                    self._post("/close", {"session_id": self.session_id})
            except Exception:  # noqa: BLE001 -- server may be gone
                pass
            self._http.close()
            self._http = None
        elif self._ws is not None:
            try:
                self._ws_call("close")
            except Exception:  # noqa: BLE001
                pass
            self._ws.close()
            self._ws = None


# ----------------------------------------------------------------------------- process


class ServerProcess:
    """An environment server running in a child process."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url

    def client(self, transport: str = "http", **kw) -> RemoteEnv:
        return RemoteEnv(self.url, transport=transport, **kw)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux), so a
    server never outlives a killed env process."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_server(factory: str, kwargs: dict | None = None, host: str = "127.0.0.1", timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, module: str = "meshrl.envs.remote",
                 args: list[str] | tuple[str, ...] = ()) -> ServerProcess:
    """Start ``python -m <module>`` (this module's server, or another that prints the same ready
    line, with ``args`` added) in a child process and wait until it listens."""
    cmd = [sys.executable, "-m", module, "--factory", factory, "--kwargs", json.dumps(kwargs or {}),
           "--host", host, "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + timeout_s
    url = None
    box: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(READY):
                box.append(line.split()[1])
                break

    th = threading.Thread(target=read, daemon=True)
    th.start()
    while time.monotonic() < deadline and proc.poll() is None and not box:
        time.sleep(0.02)
    if box:
        url = box[0]
    if url is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"environment server did not start (exit {proc.returncode}): {' '.join(cmd)}")
    return ServerProcess(proc, url)


def serve(factory: Callable[[], Environment], host: str = "127.0.0.1", port: int = 0, action_cls: type[Action] = TextAction,
          log_level: str = "warning") -> None:
    """Serve until killed; prints ``MESHRL_ENV_SERVER_READY <url>`` once the socket listens."""
    serve_app(create_app(factory, action_cls=action_cls), host, port, log_level)


def serve_app(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
    """Serve the ASGI ``app`` until killed; prints ``MESHRL_ENV_SERVER_READY <url>`` once the
    socket listens (``port`` 0: a free one)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        print(f"{READY} http://{host}:{bound}", flush=True)
        await task

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve a meshrl environment over HTTP/WebSocket.")
    ap.add_argument("--factory", default="meshrl.envs.code_env:make_code_env", help="package.module:callable")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    fn = load_factory(args.factory)
    kwargs = json.loads(args.kwargs)
    serve(lambda: fn(**kwargs), host=args.host, port=args.port)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
