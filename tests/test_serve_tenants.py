"""Keys that keep tenants apart in `meshrl serve` (`serve.keys_file`): the official `tinker` SDK and
raw HTTP against the app over the deterministic fake backend, served in a thread of this process
(its log records are captured here). Tenant A trains, saves and samples; tenant B, with its own
key, is refused everything of A's (403) while its own calls work; unknown and missing keys get
401; no key reaches a log line."""

from __future__ import annotations

import logging
import os
import warnings

import httpx
import numpy as np
import pytest

import tinker
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto

from meshrl.config.base import ConfigError
from meshrl.config.serve import ServeConfig
from meshrl.serve.app import build_app
from meshrl.serve.tenants import load_keys
from meshrl.testing.app_server import serve_in_thread
from meshrl.testing.fake_api import FakeService

KEY_A, KEY_A2, KEY_B = "tml-alice-4f1e9c", "tml-alice-second-77aa", "tml-bob-0d3b52"
os.environ["TINKER_TELEMETRY"] = "0"


def ce_datum(tokens: list[int]) -> T.Datum:
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                   loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                   "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


class Keyed:
    """The keyed server and what tenant A made on it."""

    def __init__(self, url: str, fake: FakeService):
        self.url, self.fake = url, fake
        self.a = tinker.ServiceClient(base_url=url, api_key=KEY_A)
        self.b = tinker.ServiceClient(base_url=url, api_key=KEY_B)
        self.rest_a = tinker.RestClient(base_url=url, api_key=KEY_A)
        self.rest_b = tinker.RestClient(base_url=url, api_key=KEY_B)
        self.tc = self.a.create_lora_training_client("fake-model", rank=2).result(timeout=30)
        self.tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy")
        self.tc.optim_step(T.AdamParams(learning_rate=0.1)).result(timeout=30)
        self.state = self.tc.save_state("a-state").result(timeout=30).path
        self.sampler_path = self.tc.save_weights_for_sampler("a-sampler").result(timeout=30).path
        self.sampler = self.a.create_sampling_client(model_path=self.sampler_path).result(timeout=30)

    def post(self, path: str, key: str | None, **kwargs) -> httpx.Response:
        headers = kwargs.pop("headers", {}) | ({"X-API-Key": key} if key else {})
        return httpx.post(f"{self.url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)

    def close(self) -> None:
        for client in (self.a, self.b):
            client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# key tenant\n{KEY_A} alice\n{KEY_A2} alice\n\n{KEY_B} bob\n")
    return path


@pytest.fixture(scope="module")
def keyed(keys_file):
    fake = FakeService()
    with serve_in_thread(build_app(fake, ServeConfig(keys_file=str(keys_file), poll_hold_s=0.25))) as url:
        served = Keyed(url, fake)
        yield served
        served.close()


@pytest.fixture(autouse=True)
def no_key_in_any_log_record(caplog):
    """Every test here: no API key reaches a log record of this process (server and clients)."""
    caplog.set_level(logging.DEBUG)
    yield
    text = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for key in (KEY_A, KEY_A2, KEY_B, "tml-nobody-123"):
        assert key not in text, f"an API key appears in the log:\n{text[-2000:]}"


def test_keys_file_lines_and_their_errors(tmp_path):
    good = tmp_path / "good"
    good.write_text("tml-a one\n  # comment\ntml-b two\ntml-c one\n")
    assert load_keys(good) == {"tml-a": "one", "tml-b": "two", "tml-c": "one"}
    for text, error in [("tml-a\n", "line 1: expected '<key> <tenant>', got 1 fields"),
                        ("tml-a x\nsk-secret y\n", "line 2: the key does not start with 'tml-'"),
                        ("tml-secret x\ntml-secret y\n", "line 2: this key is already listed"),
                        ("tml-a bad/name\n", "line 1: tenant 'bad/name' may only use"),
                        ("# nothing\n", "lists no keys")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=error) as err:
            load_keys(bad)
        assert "secret" not in str(err.value)  # the line's key is never repeated
    with pytest.raises(ConfigError, match="cannot read it"):
        build_app(FakeService(), ServeConfig(keys_file=str(tmp_path / "absent")))


def test_the_server_says_at_start_whether_it_runs_open(caplog, keys_file):
    build_app(FakeService(), ServeConfig())
    assert "runs open, for local use" in caplog.text
    caplog.clear()
    build_app(FakeService(), ServeConfig(keys_file=str(keys_file)))
    assert "serve.keys_file: 3 keys of 2 tenants" in caplog.text and "open" not in caplog.text


def test_every_route_authenticates_and_checks_ownership(keyed, keys_file):
    app = build_app(FakeService(), ServeConfig(keys_file=str(keys_file)))
    routes = [r for r in app.routes if hasattr(r, "methods") and r.path.startswith("/api/v1/")]
    assert len(routes) > 30
    for r in routes:  # registered through `route`, which runs the ownership check first
        assert getattr(r.endpoint, "admits_tenants", False), r.path
    for r in routes:  # and the live server refuses each one without a key
        method = next(iter(r.methods))
        path = r.path.format(**{name: "x" for name in r.param_convertors})
        reply = httpx.request(method, keyed.url + path, json={}, timeout=30)
        assert reply.status_code == 401, (method, path, reply.text)
        assert reply.json() == {"error": "missing X-API-Key: this server needs a key listed in its serve.keys_file "
                                         "(set TINKER_API_KEY)", "category": "user"}


def test_an_unknown_key_gets_401_with_a_clear_message_through_the_sdk(keyed):
    with pytest.raises(tinker.AuthenticationError, match="unknown API key: it is not listed in this server's "
                                                         "serve.keys_file") as err:
        tinker.ServiceClient(base_url=keyed.url, api_key="tml-nobody-123").create_lora_training_client(
            "fake-model", rank=1).result(timeout=30)
    assert err.value.status_code == 401 and "tml-nobody-123" not in str(err.value)
    assert keyed.post("create_session", "tml-nobody-123", json={"tags": [], "user_metadata": None,
                                                                "sdk_version": "x"}).status_code == 401


def test_a_missing_key_gets_401(keyed):
    reply = keyed.post("client/config", None, json={"sdk_version": "0.38.0"})
    assert reply.status_code == 401 and "missing X-API-Key" in reply.json()["error"]


def test_another_tenants_checkpoints_cannot_be_listed(keyed):
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.rest_b.list_checkpoints(keyed.tc.model_id).result(timeout=30)
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.rest_b.get_training_run_by_tinker_path(keyed.state).result(timeout=30)
    assert {c.tinker_path for c in keyed.rest_a.list_checkpoints(keyed.tc.model_id).result(timeout=30).checkpoints} \
        == {keyed.state, keyed.sampler_path}
    own = {c.tinker_path for c in keyed.rest_a.list_user_checkpoints().result(timeout=30).checkpoints}
    assert {keyed.state, keyed.sampler_path} <= own
    assert keyed.rest_b.list_user_checkpoints().result(timeout=30).checkpoints == []
    runs_b = keyed.rest_b.list_training_runs().result(timeout=30).training_runs
    assert keyed.tc.model_id not in {r.training_run_id for r in runs_b}
    run = keyed.rest_a.get_training_run(keyed.tc.model_id).result(timeout=30)
    assert run.model_owner == "alice" and run.last_checkpoint.tinker_path == keyed.state
    session_a = keyed.a.holder.get_session_id()
    assert session_a in keyed.rest_a.list_sessions().result(timeout=30).sessions
    assert session_a not in keyed.rest_b.list_sessions().result(timeout=30).sessions
    with pytest.raises(tinker.PermissionDeniedError):
        keyed.rest_b.get_session(session_a).result(timeout=30)
    # a second key of the same tenant reaches the same things
    rest_a2 = tinker.RestClient(base_url=keyed.url, api_key=KEY_A2)
    runs_a2 = rest_a2.list_training_runs().result(timeout=30).training_runs
    assert keyed.tc.model_id in {r.training_run_id for r in runs_a2}


def test_another_tenants_checkpoint_cannot_be_loaded(keyed):
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.b.create_training_client_from_state_with_optimizer(keyed.state).result(timeout=30)
    own = keyed.b.create_lora_training_client("fake-model", rank=2).result(timeout=30)
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # load_state* is deprecated in the SDK, still served
        own.load_state_with_optimizer(keyed.state).result(timeout=30)
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.rest_b.get_weights_info_by_tinker_path(keyed.state).result(timeout=30)
    # a path under the checkpoint root that no session of B's saved has no known owner: refused too
    with pytest.raises(tinker.PermissionDeniedError, match="not a checkpoint of tenant 'bob'"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        own.load_state("tinker://session-unknown:train:0/weights/x").result(timeout=30)
    assert keyed.a.create_training_client_from_state(keyed.state).result(timeout=30).get_info().lora_rank == 2


def test_another_tenants_checkpoint_cannot_be_sampled(keyed):
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.b.create_sampling_client(model_path=keyed.sampler_path).result(timeout=30)
    prompt = T.ModelInput.from_ints([4, 5])
    assert len(keyed.sampler.sample(prompt, 1, T.SamplingParams(max_tokens=2)).result(timeout=30).sequences) == 1


def test_another_tenants_checkpoint_cannot_be_deleted(keyed):
    doomed = keyed.tc.save_state("doomed").result(timeout=30).path
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
        keyed.rest_b.delete_checkpoint_from_tinker_path(doomed).result(timeout=30)
    def listed() -> set[str]:
        return {c.tinker_path for c in keyed.rest_a.list_checkpoints(keyed.tc.model_id).result(30).checkpoints}

    assert doomed in listed() and doomed in keyed.fake.checkpoints
    keyed.rest_a.delete_checkpoint_from_tinker_path(doomed).result(timeout=30)
    assert doomed not in listed() and doomed not in keyed.fake.checkpoints  # the backend deleted it


def test_another_tenants_model_id_cannot_be_used(keyed):
    model_id = keyed.tc.model_id
    assert keyed.post("get_info", KEY_B, json={"model_id": model_id}).status_code == 403
    request = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(
        data=[ce_datum([1, 2, 3])], loss_fn="cross_entropy"), model_id=model_id, seq_id=99)
    body = forward_backward_request_to_proto(request).SerializeToString()
    refused = keyed.post("forward_backward", KEY_B, content=body, headers={"Content-Type": "application/x-protobuf"})
    assert refused.status_code == 403 and "belongs to another tenant" in refused.json()["error"]
    for path, payload in [("optim_step", {"model_id": model_id, "seq_id": 99, "adam_params": {}}),
                          ("save_weights", {"model_id": model_id, "seq_id": 99, "path": "stolen"}),
                          ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 99, "path": "stolen"})]:
        assert keyed.post(path, KEY_B, json=payload).status_code == 403, path
    session_a = keyed.a.holder.get_session_id()
    assert keyed.post("create_model", KEY_B, json={"session_id": session_a, "model_seq_id": 99,
                                                    "base_model": "fake-model", "lora_config": {"rank": 1}}
                      ).status_code == 403
    assert keyed.post("session_heartbeat", KEY_B, json={"session_id": session_a}).status_code == 403
    assert keyed.post(f"sessions/{session_a}/finish", KEY_B).status_code == 403
    # the model was left alone: its next call runs with the next seq_id as usual
    assert keyed.tc.forward([ce_datum([1, 2, 3])], "cross_entropy").result(timeout=30).loss_fn_outputs


def test_another_tenants_sampling_session_and_request_ids_cannot_be_used(keyed):
    sampler_id = keyed.sampler._sampling_session_id
    assert ":sample:" in sampler_id
    got = httpx.get(f"{keyed.url}/api/v1/samplers/{sampler_id}", headers={"X-API-Key": KEY_B}, timeout=30)
    assert got.status_code == 403
    sample = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}
    assert keyed.post("asample", KEY_B, json=sample).status_code == 403
    mine = keyed.post("asample", KEY_A, json=sample)
    assert mine.status_code == 200
    request_id = mine.json()["request_id"]
    stolen = keyed.post("retrieve_future", KEY_B, json={"request_id": request_id})
    assert stolen.status_code == 403 and "belongs to another tenant" in stolen.json()["error"]
    assert keyed.post("retrieve_future", KEY_A2, json={"request_id": request_id}).status_code == 200
