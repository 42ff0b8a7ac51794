"""Tenants take turns at the learner (`meshrl.serve.turns`): one training call at a time, the
waiting tenant whose last turn is oldest next. Checked on the order calls reach the backend, not on
timings: `Turns` alone with futures the test completes, then the server over the fake backend with
its training calls held at a gate while one tenant queues a backlog and the other a small request."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future

import httpx
import pytest
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto

from meshrl.config.serve import ServeConfig
from meshrl.serve.app import build_app
from meshrl.serve.turns import Turns
from meshrl.testing.app_server import serve_in_thread
from meshrl.testing.fake_api import FakeService
from tests.test_serve_tenants import ce_datum

os.environ["TINKER_TELEMETRY"] = "0"
FLOODING, QUIET = "tml-flooding-5e6f", "tml-quiet-7a8b"


class _Backend:
    """Calls started by `Turns`, each a future the test completes."""

    def __init__(self):
        self.started: list[str] = []
        self.futures: list[Future] = []

    def call(self, name: str):
        def start() -> Future:
            self.started.append(name)
            self.futures.append(Future())
            return self.futures[-1]
        return start


async def _settle() -> None:
    for _ in range(5):  # a completed call ends its turn through the loop
        await asyncio.sleep(0)


def test_one_call_at_a_time_and_a_backlog_does_not_hold_another_tenant():
    async def scenario() -> list[str]:
        turns, backend = Turns(asyncio.get_running_loop(), hold_limit_s=60), _Backend()
        for i in range(1, 5):
            turns.add("a", backend.call(f"a{i}"))
        turns.add("b", backend.call("b1"))
        turns.add("b", backend.call("b2"))
        turns.add("c", backend.call("c1"))
        assert backend.started == ["a1"]  # one at a time
        while len(backend.futures) < 7:
            backend.futures[-1].set_result(None)
            await _settle()
        return backend.started

    # b and c never had a turn: they go before a's next; then the least recently served tenant
    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


def test_a_call_that_fails_before_the_backend_takes_no_turn_and_a_lost_one_is_given_up():
    async def scenario() -> list[str]:
        turns, backend = Turns(asyncio.get_running_loop(), hold_limit_s=0.05), _Backend()
        turns.add("a", lambda: None)  # failed before reaching the backend: the next call starts at once
        turns.add("a", backend.call("a1"))
        turns.add("b", backend.call("b1"))
        assert backend.started == ["a1"]
        await asyncio.sleep(0.2)  # a1 never completes: its turn ends after hold_limit_s
        assert backend.started == ["a1", "b1"]
        backend.futures[0].set_result(None)  # a late completion ends no other turn
        await _settle()
        return backend.started

    assert asyncio.run(scenario()) == ["a1", "b1"]


class _Tenant:
    def __init__(self, url: str, key: str):
        self.url, self.key = url, key
        self.session = self.post("create_session", json={"tags": [], "user_metadata": None,
                                                         "sdk_version": "0.38.0"}).json()["session_id"]

    def post(self, path: str, **kwargs) -> httpx.Response:
        reply = httpx.post(f"{self.url}/api/v1/{path}", headers=kwargs.pop("headers", {}) | {"X-API-Key": self.key},
                           timeout=30, **kwargs)
        assert reply.status_code == 200, reply.text
        return reply

    def result(self, reply: httpx.Response) -> httpx.Response:
        while True:
            polled = self.post_any("retrieve_future", json={"request_id": reply.json()["request_id"]})
            if polled.status_code != 408:
                assert polled.status_code == 200 and b'"error"' not in polled.content, polled.text
                return polled

    def post_any(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{path}", headers={"X-API-Key": self.key}, timeout=30, **kwargs)

    def model(self, seq: int) -> str:
        reply = self.post("create_model", json={"session_id": self.session, "model_seq_id": seq,
                                                "base_model": "fake-model", "lora_config": {"rank": 2}})
        self.result(reply)
        return reply.json()["model_id"]

    def forward_backward(self, model_id: str, seq_id: int, tag: int) -> httpx.Response:
        request = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(
            data=[ce_datum([tag, 1, 2])], loss_fn="cross_entropy"), model_id=model_id, seq_id=seq_id)
        return self.post("forward_backward", content=forward_backward_request_to_proto(request).SerializeToString(),
                         headers={"Content-Type": "application/x-protobuf"})


@pytest.fixture
def server(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{FLOODING} flooding\n{QUIET} quiet\n")
    fake = FakeService()
    with serve_in_thread(build_app(fake, ServeConfig(keys_file=str(keys), poll_hold_s=0.25))) as url:
        yield url, fake


def test_a_tenants_backlog_of_training_calls_does_not_hold_another_tenants_call(server):
    url, fake = server
    flooding, quiet = _Tenant(url, FLOODING), _Tenant(url, QUIET)
    a1, a2, b = flooding.model(0), flooding.model(1), quiet.model(0)
    fake.gate.clear()  # every training call that reaches the backend waits there
    try:
        backlog = [flooding.forward_backward(model, seq, 10 * seq + m) for seq in range(1, 5)
                   for m, model in enumerate((a1, a2))]
        deadline = time.monotonic() + 30
        while not fake.calls_of(a1) and time.monotonic() < deadline:  # a1's first call holds the backend
            time.sleep(0.01)
        mine = [quiet.forward_backward(b, seq, 100 + seq) for seq in (1, 2)]
    finally:
        fake.gate.set()
    for reply in backlog:
        flooding.result(reply)
    for reply in mine:
        quiet.result(reply)
    reached = [(model, tags[0]) for model, op, tags in fake.calls if op == "forward_backward"]
    # one call at a time: the quiet tenant's first call follows the call that was running, its
    # second one more of the backlog; each model's calls stay in seq_id order
    assert reached == [(a1, 10), (b, 101), (a2, 11), (b, 102), (a1, 20), (a2, 21), (a1, 30), (a2, 31),
                       (a1, 40), (a2, 41)]
