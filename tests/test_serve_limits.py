"""A hostile tenant against `meshrl serve` (`serve.limits`), over the deterministic fake backend
served in a thread of this process, with two tenants on a keys file: tenant A sends what the
limits refuse (oversized bodies, zstd bombs, huge LoRA ranks and declared shapes, poisoned
sampling parameters, deep or broken JSON, checkpoint names that climb out of their folder, a
flood of training work) and each request is refused in bounded time with a 4xx naming the field
and the limit, while tenant B, through the official SDK, keeps training and sampling."""

from __future__ import annotations

import json
import os
import time

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto

from meshrl.config.serve import ServeConfig, ServeLimits
from meshrl.serve.app import build_app
from meshrl.testing.app_server import serve_in_thread
from meshrl.testing.fake_api import FakeService
from tests.conftest import sdk_user_error
from tests.test_serve_tenants import ce_datum

KEY_A, KEY_B = "tml-hostile-1a2b", "tml-neighbour-3c4d"
os.environ["TINKER_TELEMETRY"] = "0"
LIMITS = ServeLimits(max_body_bytes=1 << 20, max_decompressed_bytes=2 << 20, max_lora_rank=64,
                     max_tokens_per_datum=512, max_tokens_per_request=1024, max_datums_per_request=8,
                     max_tensor_elements=4096, max_num_samples=16, max_sample_tokens=64, max_prompt_tokens=256,
                     max_metadata_bytes=1024, max_sessions_per_tenant=6, max_models_per_tenant=3,
                     max_custom_loss_nodes=50, max_custom_loss_elements=10_000, max_pending_training=4)


class Served:
    """The server, tenant A's raw session and model, and tenant B's SDK training client and sampler."""

    def __init__(self, url: str, fake: FakeService):
        self.url, self.fake = url, fake
        self._seq = 0
        self.session = self.post("create_session", KEY_A, json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()[
            "session_id"]
        created = self.post("create_model", KEY_A, json={"session_id": self.session, "model_seq_id": 0,
                                                         "base_model": "fake-model", "lora_config": {"rank": 4}})
        self.model = created.json()["model_id"]
        self.b = tinker.ServiceClient(base_url=url, api_key=KEY_B)
        self.tc = self.b.create_lora_training_client("fake-model", rank=2).result(timeout=30)
        self.sampler = self.b.create_sampling_client(base_model="fake-model").result(timeout=30)
        self.sampler_a = self.post("create_sampling_session", KEY_A, json={
            "session_id": self.session, "sampling_session_seq_id": 0, "base_model": "fake-model"}).json()[
            "sampling_session_id"]

    def next_seq(self) -> int:
        """The next seq_id of tenant A's model (every request that reaches its queue takes one)."""
        self._seq += 1
        return self._seq

    def post(self, path: str, key: str, **kwargs) -> httpx.Response:
        headers = kwargs.pop("headers", {}) | {"X-API-Key": key}
        return httpx.post(f"{self.url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)

    def result(self, reply: httpx.Response) -> dict:
        """The settled outcome of a submitted request of tenant A."""
        assert reply.status_code == 200, reply.text
        while True:
            polled = self.post("retrieve_future", KEY_A, json={"request_id": reply.json()["request_id"]})
            if polled.status_code != 408:  # a served sample or forward_backward comes as protobuf
                protobuf = polled.headers["content-type"] == "application/x-protobuf"
                return {"protobuf": polled.content} if protobuf else polled.json()

    def neighbour_works(self) -> None:
        """Tenant B trains a step and samples, as if nothing happened."""
        self.tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy").result(timeout=30)
        self.tc.optim_step(T.AdamParams(learning_rate=0.1)).result(timeout=30)
        out = self.sampler.sample(T.ModelInput.from_ints([1, 2]), 1, T.SamplingParams(max_tokens=2)).result(30)
        assert len(out.sequences[0].tokens) == 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY_A} hostile\n{KEY_B} neighbour\n")
    fake = FakeService()
    with serve_in_thread(build_app(fake, ServeConfig(keys_file=str(keys), poll_hold_s=0.25, limits=LIMITS))) as url:
        s = Served(url, fake)
        yield s
        s.b.close("success").result(timeout=30)


def _refused(reply: httpx.Response, status: int, *phrases: str) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["category"] == "user" and "\n" not in body["error"], body
    for phrase in phrases:
        assert phrase in body["error"], body["error"]
    return body["error"]


def _sample(served: Served, **fields) -> dict:
    params = fields.pop("sampling_params", {"max_tokens": 2})
    return {"sampling_session_id": served.sampler_a, "seq_id": 0, "num_samples": 1, "sampling_params": params,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": fields.pop("tokens", [1, 2])}]}, **fields}


def _forward_backward_proto(served: Served, data: list[T.Datum]):
    request = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id=served.model, seq_id=served.next_seq())
    return forward_backward_request_to_proto(request)


def _forward_backward(served: Served, data: list[T.Datum]) -> bytes:
    return _forward_backward_proto(served, data).SerializeToString()


def test_poisoned_sampling_parameters_are_refused_at_the_edge(served):
    cases = [({"sampling_params": {"max_tokens": 2, "seed": 2**64}}, "sampling_params.seed = 18446744073709551616"),
             ({"sampling_params": {"max_tokens": 2, "seed": -1}}, "sampling_params.seed = -1"),
             ({"sampling_params": {"max_tokens": 2, "temperature": float("inf")}}, "temperature = inf"),
             ({"sampling_params": {"max_tokens": 2, "top_p": 0.0}}, "top_p = 0.0"),
             ({"sampling_params": {"max_tokens": 2, "top_k": -7}}, "top_k = -7"),
             ({"sampling_params": {"max_tokens": 2, "stop": ["x"] * 17}}, "serve.limits.max_stop_sequences"),
             ({"sampling_params": {"max_tokens": 2, "stop": [2**40]}}, "stop: token id 1099511627776"),
             ({"sampling_params": {"max_tokens": 65}}, "max_tokens = 65: over the limit of 64"),
             ({"num_samples": 5_000_000}, "num_samples = 5000000: over the limit of 16 (serve.limits.max_num_samples)"),
             ({"tokens": list(range(300))}, "prompt length = 300: over the limit of 256"),
             ({"tokens": [1, -5]}, "token ids must lie in [0, 2**31)"),
             ({"topk_prompt_logprobs": 10_000}, "topk_prompt_logprobs = 10000")]
    for fields, phrase in cases:  # sent as Python's json writes them (inf as Infinity)
        _refused(served.post("asample", KEY_A, content=json.dumps(_sample(served, **fields)),
                             headers={"Content-Type": "application/json"}), 400, phrase)
    served.neighbour_works()


def test_a_declared_target_shape_is_checked_against_the_prompt_before_anything_is_built(served):
    huge = {"data": [1], "dtype": "int64", "shape": [1, 20_000_000]}  # a few hundred bytes on the wire
    started = time.perf_counter()
    reply = served.post("asample", KEY_A, json=_sample(served, target_prompt_logprobs=huge))
    assert time.perf_counter() - started < 60  # refused, not built (building it took many seconds and 1.4 GB)
    outcome = served.result(reply)
    assert outcome["category"] == "user" and "shape [1, 20000000]" in outcome["error"], outcome
    too_many = {"data": [1] * 2, "dtype": "int64", "shape": [1, 2], "sparse_crow_indices": [0, 2],
                "sparse_col_indices": [0, 1]}
    fits = served.result(served.post("asample", KEY_A, json=_sample(served, target_prompt_logprobs=too_many)))
    assert "error" not in fits  # a shape that matches the prompt and the limit is served


def test_training_sizes_are_bounded_before_the_datums_are_decoded(served):
    headers = {"Content-Type": "application/x-protobuf"}
    too_long = _forward_backward(served, [ce_datum(list(range(600)))])
    outcome = served.result(served.post("forward_backward", KEY_A, content=too_long, headers=headers))
    assert "data[0]: tokens = 599: over the limit of 512 (serve.limits.max_tokens_per_datum)" in outcome["error"]
    many = _forward_backward(served, [ce_datum([1, 2, 3])] * 9)
    outcome = served.result(served.post("forward_backward", KEY_A, content=many, headers=headers))
    assert "number of datums = 9: over the limit of 8" in outcome["error"]
    total = _forward_backward(served, [ce_datum(list(range(300)))] * 4)
    outcome = served.result(served.post("forward_backward", KEY_A, content=total, headers=headers))
    assert "tokens over all datums = 1196: over the limit of 1024" in outcome["error"]
    msg = _forward_backward_proto(served, [ce_datum([1, 2, 3])])
    weights = msg.data[0].loss_fn_inputs["weights"]
    weights.ClearField("dense")
    weights.sparse_csr.crow_indices = np.array([0] * 20_001, dtype=np.int64).tobytes()
    weights.shape[:] = [20_000, 20_000]  # 400 M elements declared, none sent
    outcome = served.result(served.post("forward_backward", KEY_A, content=msg.SerializeToString(), headers=headers))
    assert "elements of shape [20000, 20000] = 400000000: over the limit of 4096" in outcome["error"]
    served.neighbour_works()


def test_bodies_are_bounded_while_they_are_read_and_inflated(served):
    headers = {"Content-Type": "application/x-protobuf"}
    _refused(served.post("forward_backward", KEY_A, content=b"\0" * (2 << 20), headers=headers), 413,
             "serve.limits.max_body_bytes")
    # a few kB that inflate to 64 MiB, naming the sender's own model first
    bomb = zstandard.ZstdCompressor().compress(_model_id_field(served.model) + b"\0" * (64 << 20))
    assert len(bomb) < (1 << 20)
    _refused(served.post("forward_backward", KEY_A, content=bomb, headers=headers | {"Content-Encoding": "zstd"}),
             413, "inflates past 2097152 bytes (serve.limits.max_decompressed_bytes)")
    served.neighbour_works()


def _model_id_field(model_id: str) -> bytes:
    """A ForwardBackwardRequest's model_id as its serialiser writes it first: tag, length, bytes."""
    data = model_id.encode()
    assert len(data) < 128
    return bytes([0x0A, len(data)]) + data


def test_ownership_is_checked_before_a_body_is_inflated(served):
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    # tenant B's bomb naming tenant A's model: refused for ownership (403), never inflated (not a 413)
    bomb = zstandard.ZstdCompressor().compress(_model_id_field(served.model) + b"\0" * (64 << 20))
    _refused(served.post("forward_backward", KEY_B, content=bomb, headers=headers), 403,
             f"model_id {served.model!r} belongs to another tenant")
    # a body that does not start with model_id cannot be checked before it is decoded: refused
    msg = _forward_backward_proto(served, [ce_datum([1, 2, 3])])
    model_last = msg.SerializeToString()[len(_model_id_field(served.model)):] + _model_id_field(served.model)
    _refused(served.post("forward_backward", KEY_A, content=model_last,
                         headers={"Content-Type": "application/x-protobuf"}), 400, "must start with model_id")
    # the SDK's own body (model_id first) passes the early check and is served
    outcome = served.result(served.post("forward_backward", KEY_A, content=msg.SerializeToString(),
                                        headers={"Content-Type": "application/x-protobuf"}))
    assert "error" not in outcome, outcome
    # B's own model first and A's model again later (the parser keeps the last): the check of the decoded
    # body still refuses it
    twice = _model_id_field(served.tc.model_id) + msg.SerializeToString()
    _refused(served.post("forward_backward", KEY_B, content=twice, headers={"Content-Type": "application/x-protobuf"}),
             403, "belongs to another tenant")
    served.neighbour_works()


def test_malformed_json_and_encodings_are_a_400(served):
    for body in (b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000, b'{"session_id": '):
        _refused(served.post("session_heartbeat", KEY_A, content=body,
                             headers={"Content-Type": "application/json"}), 400, "body is not JSON")
    deep = '{"tags": [], "sdk_version": "x", "user_metadata": {"a": ' + "[" * 3000 + "]" * 3000 + "}}"
    reply = served.post("create_session", KEY_A, content=deep.encode(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["category"] == "user"
    served.neighbour_works()


def test_what_a_tenant_creates_and_keeps_is_bounded(served):
    _refused(served.post("create_model", KEY_A, json={"session_id": served.session, "model_seq_id": 1,
                                                      "base_model": "fake-model", "lora_config": {"rank": 1_000_000}}),
             400, "lora_config.rank = 1000000: over the limit of 64 (serve.limits.max_lora_rank)")
    _refused(served.post("create_session", KEY_A, json={"tags": [], "sdk_version": "x",
                                                         "user_metadata": {"blob": "x" * 5000}}),
             400, "serve.limits.max_metadata_bytes")
    extra = served.post("create_session", KEY_A, json={"tags": [], "user_metadata": None, "sdk_version": "x"}).json()[
        "session_id"]
    for seq in (0, 1):  # with the first session's model: 3
        served.post("create_model", KEY_A, json={"session_id": extra, "model_seq_id": seq,
                                                 "base_model": "fake-model", "lora_config": {"rank": 2}})
    _refused(served.post("create_model", KEY_A, json={"session_id": extra, "model_seq_id": 2,
                                                      "base_model": "fake-model", "lora_config": {"rank": 2}}),
             400, "over the limit of 3 (serve.limits.max_models_per_tenant)")
    served.post(f"sessions/{extra}/finish", KEY_A)  # its models no longer count
    opened = [served.post("create_session", KEY_A, json={"tags": [], "user_metadata": None, "sdk_version": "x"}) for _ in range(6)]
    assert [r.status_code for r in opened] == [200] * 5 + [400]  # 6 open sessions with the first
    assert "serve.limits.max_sessions_per_tenant" in opened[-1].json()["error"]
    for reply in opened[:5]:
        served.post(f"sessions/{reply.json()['session_id']}/finish", KEY_A)
    # the neighbour's own quota is untouched
    other = tinker.ServiceClient(base_url=served.url, api_key=KEY_B)
    other.create_lora_training_client("fake-model", rank=2).result(timeout=30)
    other.close("success").result(timeout=30)
    served.neighbour_works()


def test_checkpoint_names_are_a_whitelist(served):
    for name in (".", "..", "a/b", "x" * 129, ".hidden"):
        for path in ("save_weights", "save_weights_for_sampler"):
            _refused(served.post(path, KEY_A, json={"model_id": served.model, "path": name, "seq_id": 10**6}), 400,
                     f"{path}.path = ", "not starting with a dot")
    saved = served.result(served.post("save_weights", KEY_A, json={"model_id": served.model, "path": "ok-1.v2",
                                                                   "seq_id": served.next_seq()}))
    assert saved["path"].endswith("/weights/ok-1.v2")


@pytest.mark.slow  # ~10 s on 2 cores
def test_a_tenant_flooding_training_is_held_to_its_quota(served):
    headers = {"Content-Type": "application/x-protobuf"}
    bodies = [_forward_backward(served, [ce_datum([1, 2, 3])]) for _ in range(6)]
    served.fake.delay_s = 2.0  # each call: the first of them still runs while the sixth arrives
    try:
        replies = [served.post("forward_backward", KEY_A, content=body, headers=headers) for body in bodies]
        assert [r.status_code for r in replies] == [200] * 4 + [429] * 2
        assert "serve.limits.max_pending_training" in replies[-1].json()["error"]
        served.tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy").result(timeout=30)  # B is not held
        for reply in replies[:4]:
            assert "error" not in served.result(reply)
    finally:
        served.fake.delay_s = 0.0
    served._seq -= 2  # the refused requests took no place in the queue; A's quota is back once its work is done
    reply = served.post("forward_backward", KEY_A, content=_forward_backward(served, [ce_datum([1, 2, 3])]),
                        headers=headers)
    assert "error" not in served.result(reply)


def test_server_errors_carry_no_traceback_or_path(served, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("could not open /srv/meshrl/out/api/secret/adapter.safetensors\nTraceback (most recent "
                           "call last):\n  File \"/usr/lib/python3/x.py\", line 1")

    monkeypatch.setattr(served.fake, "create_sampling_client", broken)
    reply = served.post("create_sampling_session", KEY_A, json={
        "session_id": served.session, "sampling_session_seq_id": 9, "base_model": "fake-model"})
    assert reply.status_code == 500
    body = reply.json()
    assert body["category"] == "server" and "\n" not in body["error"] and "/srv" not in body["error"]
    assert "RuntimeError: could not open <path>" in body["error"]
    error_id = body["error"].split("server error ")[1].split(":")[0]
    assert f"server error {error_id}" in caplog.text and "/srv/meshrl/out/api/secret" in caplog.text


def test_the_sdk_sees_a_refusal_as_a_bad_request(served):
    with pytest.raises(tinker.BadRequestError, match="sampling_params.seed = 18446744073709551616"):
        served.sampler.sample(T.ModelInput.from_ints([1, 2]), 1, T.SamplingParams(max_tokens=2, seed=2**64)).result(30)
    served.neighbour_works()


def outer_power(logprobs, weights):
    """Grows as tokens to the fourth power: [T, T, T, T] from two [T] tensors."""
    big = torch.einsum("i,j,k,l->ijkl", logprobs, weights, logprobs, weights)
    return big.sum(), {}


def weighted(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {}


def test_a_custom_loss_is_sized_from_its_datums_shapes_before_it_runs(served):
    hostile = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    try:
        tc = hostile.create_lora_training_client("fake-model", rank=2).result(timeout=30)
        power = hostile.create_custom_loss(outer_power, {"logprobs": 1, "weights": 1}).result(timeout=30)
        small = hostile.create_custom_loss(weighted, {"logprobs": 1, "weights": 1}).result(timeout=30)
        started = time.perf_counter()
        message = sdk_user_error(tc.forward_backward_custom([ce_datum(list(range(12)))], power), timeout=30)
        assert time.perf_counter() - started < 60  # refused before it runs, whatever the machine's load
        assert "data[0]: the largest tensor custom loss 'outer_power' builds (elements) = 14641: over the limit " \
               "of 10000 (serve.limits.max_custom_loss_elements)" in message  # 11 targets: 11**4 elements
        assert served.fake.calls_of(tc.model_id) == []  # nothing reached the learner
        tc.forward_backward_custom([ce_datum(list(range(8)))], power).result(timeout=30)  # 7**4 fits
        tc.forward_backward_custom([ce_datum(list(range(400)))], small).result(timeout=30)
    finally:
        hostile.close("success").result(timeout=30)
    served.neighbour_works()


def test_optimizer_hyperparameters_must_be_finite(served):
    reply = served.post("optim_step", KEY_A, content=json.dumps({
        "model_id": served.model, "seq_id": served.next_seq(),
        "adam_params": {"learning_rate": float("inf"), "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}}),
        headers={"Content-Type": "application/json"})
    outcome = served.result(reply)
    assert outcome["category"] == "user" and "adam_params.learning_rate = inf: must be finite" in outcome["error"]
    served.neighbour_works()
