"""`meshrl serve` driven by the official, unmodified `tinker` SDK (0.38.0) over HTTP, against the
deterministic fake backend (`meshrl.testing.fake_api`): every value the SDK returns is predicted
from the fake's arithmetic, so these check the wire format (protobuf tensors, float32 exactly),
the per-model `seq_id` ordering, the error categories and the session lifecycle.

The server runs in a thread of this process (uvicorn on a free port) so the tests can read the
fake's call log; one test runs `meshrl serve` itself as a subprocess and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import tinker
import zstandard
from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from meshrl.api.errors import UserError
from tests.conftest import sdk_user_error
from meshrl.config.base import ConfigError
from meshrl.config.serve import ServeConfig, ServeLimits
from meshrl.serve import wire
from meshrl.serve.app import TinkerServer, build_app
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.tenants import OPEN_TENANT
from meshrl.serve.futures import JsonResult
from meshrl.serve.training import LoraSpec
from meshrl.testing.app_server import serve_in_thread
from meshrl.testing.fake_api import FakeService, fake_logprobs

ROOT = Path(__file__).resolve().parents[1]
ALIAS = "Qwen/Qwen3-4B-Instruct-2507"

os.environ.setdefault("TINKER_API_KEY", "tml-test")
os.environ["TINKER_TELEMETRY"] = "0"


class _Served:
    def __init__(self, url: str, fake: FakeService):
        self.url = url
        self.fake = fake


@pytest.fixture(scope="module")
def served():
    """The app over a fresh fake, served by uvicorn in a thread; stopped at the end."""
    fake = FakeService("fake-model", 4096)
    with serve_in_thread(build_app(fake, ServeConfig(poll_hold_s=0.25, seq_gap_timeout_s=1.0))) as url:
        yield _Served(url, fake)


@pytest.fixture(scope="module")
def service(served):
    client = tinker.ServiceClient(base_url=served.url)
    yield client
    client.close("success").result(timeout=30)


def ce_datum(tokens: list[int], weights: list[float] | None = None) -> T.Datum:
    """A cross-entropy datum: input tokens[:-1], targets tokens[1:]."""
    targets = tokens[1:]
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                   loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64),
                                   "weights": np.array(weights or [1.0] * len(targets), dtype=np.float32)})


def _eventually(check, timeout_s: float = 10.0) -> bool:
    """Whether ``check()`` becomes true within the timeout (for calls the server makes after its reply)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def expected_logprobs(datum: T.Datum, w: float) -> np.ndarray:
    return fake_logprobs(datum.loss_fn_inputs["target_tokens"].to_torch(), w).numpy()


def test_capabilities_advertise_the_served_model_and_its_aliases(served):
    caps = tinker.RestClient(base_url=served.url).get_server_capabilities().result(timeout=30)
    names = {m.model_name: m.max_context_length for m in caps.supported_models}
    assert names["fake-model"] == 4096 and names[ALIAS] == 4096 and "meta-llama/Llama-3.2-1B" in names


def test_training_round_trip_returns_the_backends_float32_values(service, served):
    tc = service.create_lora_training_client(ALIAS, rank=4).result(timeout=30)
    info = tc.get_info()
    assert info.model_data.model_name == ALIAS and info.lora_rank == 4 and ":train:" in tc.model_id
    data = [ce_datum([3, 5, 8, 13, 21]), ce_datum([2, 4, 6], [0.5, 2.0])]

    out = tc.forward_backward(data, "cross_entropy").result(timeout=30)
    for datum, result in zip(data, out.loss_fn_outputs):
        got = result["logprobs"]
        assert got.dtype == "float32" and got.shape == [datum.model_input.length]
        np.testing.assert_array_equal(np.asarray(got.data, dtype=np.float32), expected_logprobs(datum, 0.0))
    expected_loss = sum(float(-(torch.from_numpy(expected_logprobs(d, 0.0)) * d.loss_fn_inputs["weights"].to_torch())
                              .sum()) for d in data)
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-6)

    fwd = tc.forward(data, "cross_entropy").result(timeout=30)  # no gradient
    np.testing.assert_array_equal(fwd.loss_fn_outputs[1]["logprobs"].data, expected_logprobs(data[1], 0.0))

    grad = 4.0 + 2.5  # the summed weights of the forward_backward
    step = tc.optim_step(T.AdamParams(learning_rate=0.5)).result(timeout=30)
    assert step.metrics == {"grad:sum": grad, "step:max": 1.0}
    w1 = -0.5 * grad
    after = tc.forward(data, "cross_entropy").result(timeout=30)
    np.testing.assert_array_equal(after.loss_fn_outputs[0]["logprobs"].data, expected_logprobs(data[0], w1))

    saved = tc.save_state("ckpt-1").result(timeout=30)
    assert saved.path == f"tinker://{tc.model_id}/weights/ckpt-1"
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=0.5)).result(timeout=30)  # w moves on
    with warnings.catch_warnings():  # load_state is deprecated in the SDK, still served
        warnings.simplefilter("ignore", FutureWarning)
        tc.load_state(saved.path).result(timeout=30)
        restored = tc.forward(data, "cross_entropy").result(timeout=30)
        np.testing.assert_array_equal(restored.loss_fn_outputs[0]["logprobs"].data, expected_logprobs(data[0], w1))
        tc.load_state_with_optimizer(saved.path).result(timeout=30)

    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result(timeout=30)
    assert resumed.get_info().lora_rank == 4 and resumed.get_info().model_data.model_name == ALIAS
    again = resumed.forward(data, "cross_entropy").result(timeout=30)
    np.testing.assert_array_equal(again.loss_fn_outputs[0]["logprobs"].data, expected_logprobs(data[0], w1))
    ops = [op for op, _ in served.fake.calls_of(resumed.model_id)]
    assert ops == ["load_state_with_optimizer", "forward"]


def test_sampling_returns_sequences_and_prompt_logprobs(service, served):
    tc = service.create_lora_training_client("fake-model", rank=2).result(timeout=30)
    tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=0.25)).result(timeout=30)
    w = -0.25 * 2.0
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=30)
    assert sampler.get_base_model() == "fake-model"

    prompt = T.ModelInput.from_ints([5, 6, 10])
    params = T.SamplingParams(max_tokens=4, stop=[15])
    resp = sampler.sample(prompt, 2, params, include_prompt_logprobs=True).result(timeout=30)
    first, second = resp.sequences
    assert (first.tokens, first.stop_reason) == ([11, 12, 13, 14], "length")
    assert (second.tokens, second.stop_reason) == ([14, 15], "stop")  # stopped at token 15
    np.testing.assert_array_equal(np.asarray(second.logprobs, dtype=np.float32), fake_logprobs([14, 15], w).numpy())
    assert first.sequence_id and first.sequence_id != second.sequence_id
    assert resp.prompt_logprobs[0] is None
    np.testing.assert_array_equal(np.asarray(resp.prompt_logprobs[1:], dtype=np.float32),
                                  fake_logprobs([6, 10], w).numpy())

    logprobs = sampler.compute_logprobs(prompt).result(timeout=30)
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(fake_logprobs([6, 10], w).tolist())

    path = tc.save_weights_for_sampler("named").result(timeout=30).path
    assert path == f"tinker://{tc.model_id}/sampler_weights/named"
    from_path = service.create_sampling_client(model_path=path).result(timeout=30)
    assert from_path.get_base_model() == "fake-model"
    assert from_path.sample(prompt, 1, params).result(timeout=30).sequences[0].logprobs == \
        pytest.approx(fake_logprobs([11, 12, 13, 14], w).tolist())
    base = service.create_sampling_client(base_model=ALIAS).result(timeout=30)
    assert base.get_base_model() == ALIAS
    assert base.sample(prompt, 1, params).result(timeout=30).sequences[0].logprobs == \
        pytest.approx(fake_logprobs([11, 12, 13, 14], 0.0).tolist())


def _with_provenance(datum: T.Datum, prompt_length: int, seq) -> T.Datum:
    """The runs the cookbook names a single-turn datum's tokens with (rl_loop.with_sampled_provenance)."""
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[T.PromptProvenanceSpan(sequence_id=sid, length=prompt_length),
                     T.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id=sid, offset=1, length=prompt_length - 1),
                        T.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))])


def test_stable_reinforce_trains_on_what_the_sampler_recorded(service, served):
    tc = service.create_lora_training_client("fake-model", rank=2).result(timeout=30)
    tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=0.25)).result(timeout=30)
    w = -0.25 * 2.0  # the learner's weight; the sampler below samples the base model (w = 0)
    sampler = service.create_sampling_client(base_model="fake-model", record_stability_info=True).result(timeout=30)
    prompt = [5, 6, 10]
    resp = sampler.sample(T.ModelInput.from_ints(prompt), 2, T.SamplingParams(max_tokens=4)).result(timeout=30)
    data, expected = [], 0.0
    for seq, advantage in zip(resp.sequences, [1.0, -0.5]):
        tokens, n = prompt + seq.tokens, len(prompt) - 1
        datum = T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": np.full(len(tokens) - 1, -7.0, dtype=np.float32),  # not the sampler's: unused
            "advantages": np.array([0.0] * n + [advantage] * len(seq.tokens), dtype=np.float32)})
        data.append(_with_provenance(datum, len(prompt), seq))
        # the fake's RL value -sum(exp(learner - sampler logprob) A), with the sampler's RECORDED logprobs
        recorded = fake_logprobs(seq.tokens, 0.0).numpy()
        expected -= float(np.sum(np.exp(expected_logprobs(datum, w)[n:] - recorded) * advantage))
    out = tc.forward_backward(data, "stable_reinforce").result(timeout=30)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)

    unrecorded = service.create_sampling_client(base_model="fake-model").result(timeout=30)
    [plain] = unrecorded.sample(T.ModelInput.from_ints(prompt), 1, T.SamplingParams(max_tokens=4)).result(30).sequences
    assert f"no recorded sequence {plain.sequence_id!r}" in sdk_user_error(
        tc.forward_backward([_with_provenance(data[0], len(prompt), plain)], "stable_reinforce"))
    assert "needs the datum's provenance" in sdk_user_error(
        tc.forward_backward([T.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)],
                            "stable_reinforce"))
    with tinker.ServiceClient(base_url=served.url) as other:  # another session cannot name these sequences
        stranger = other.create_lora_training_client("fake-model", rank=2).result(timeout=30)
        assert "no recorded sequence" in sdk_user_error(stranger.forward_backward(data, "stable_reinforce"))


def test_dro_and_gspo_reach_the_backend_with_their_config(service, served):
    tc = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    datum = T.Datum(model_input=T.ModelInput.from_ints([70, 71, 72]), loss_fn_inputs={
        "target_tokens": np.array([71, 72, 73], dtype=np.int64), "logprobs": np.zeros(3, dtype=np.float32),
        "advantages": np.array([0.0, 1.0, 2.0], dtype=np.float32),
        "sequence_ratio_mask": np.array([0.0, 1.0, 1.0], dtype=np.float32)})
    expected = -float(np.sum(np.exp(expected_logprobs(datum, 0.0)) * np.array([0.0, 1.0, 2.0])))
    for loss_fn, config in (("dro", {"beta": 0.1}), ("gspo", {"clip_low_threshold": 0.9})):
        out = tc.forward_backward([datum], loss_fn, config).result(timeout=30)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
    assert served.fake.calls_of(tc.model_id) == [("forward_backward", (70,))] * 2


def test_a_result_slower_than_a_poll_hold_arrives_after_408s(service, served):
    tc = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    served.fake.delay_s = 1.0  # four polls of serve.poll_hold_s = 0.25 s time out first
    try:
        out = tc.forward_backward([ce_datum([4, 5, 6])], "cross_entropy").result(timeout=30)
    finally:
        served.fake.delay_s = 0.0
    np.testing.assert_array_equal(out.loss_fn_outputs[0]["logprobs"].data, expected_logprobs(ce_datum([4, 5, 6]), 0.0))


def test_two_training_clients_keep_their_own_queues(service, served):
    a = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    b = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    futures = []
    for i in range(4):  # submitted without waiting, interleaved across the two clients
        futures.append((a, 100 + i, a.forward_backward([ce_datum([100 + i, 1, 2])], "cross_entropy")))
        futures.append((b, 200 + i, b.forward([ce_datum([200 + i, 1])], "cross_entropy")))
    step = a.optim_step(T.AdamParams(learning_rate=1.0))
    for client, _, future in futures:
        out = future.result(timeout=30)
        np.testing.assert_array_equal(out.loss_fn_outputs[0]["logprobs"].data,
                                      fake_logprobs([1, 2] if client is a else [1], 0.0).numpy())
    assert step.result(timeout=30).metrics["grad:sum"] == 4 * 2.0
    assert served.fake.calls_of(a.model_id) == [("forward_backward", (100 + i,)) for i in range(4)] + \
        [("optim_step", ())]
    assert served.fake.calls_of(b.model_id) == [("forward", (200 + i,)) for i in range(4)]


def test_a_batch_the_sdk_sends_in_chunks_runs_in_order_and_comes_back_whole(service, served):
    tc = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    data = [ce_datum([i, 1]) for i in range(1030)]  # the SDK sends 1024 + 6, the first chunk last
    out = tc.forward_backward(data, "cross_entropy").result(timeout=60)
    assert len(out.loss_fn_outputs) == 1030
    assert out.metrics["loss:sum"] == pytest.approx(sum(-float(expected_logprobs(d, 0.0)[0]) for d in data))
    calls = served.fake.calls_of(tc.model_id)
    assert [len(tags) for _, tags in calls] == [1024, 6]
    assert [t for _, tags in calls for t in tags] == list(range(1030))


def _post_forward_backward(url: str, model_id: str, seq_id: int, first_token: int) -> str:
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=[ce_datum([first_token, 1, 2])], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(request).SerializeToString())
    reply = httpx.post(f"{url}/api/v1/forward_backward", content=body, timeout=30,
                       headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    reply.raise_for_status()
    return reply.json()["request_id"]


def _retrieve(url: str, request_id: str) -> httpx.Response:
    for _ in range(100):
        reply = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=30)
        if reply.status_code != 408:
            return reply
    raise AssertionError(f"{request_id} never finished")


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in(service, served):
    model_id = service.create_lora_training_client("fake-model", rank=1).result(timeout=30).model_id
    request_ids = {seq: _post_forward_backward(served.url, model_id, seq, 10 * seq) for seq in (3, 2, 1)}
    assert _post_forward_backward(served.url, model_id, 2, 20) == request_ids[2]  # a retry: same request
    for seq, request_id in request_ids.items():
        reply = _retrieve(served.url, request_id)
        assert reply.headers["content-type"] == "application/x-protobuf"
        out = deserialize_forward_backward_output(reply.content)
        assert len(out.loss_fn_outputs) == 1
    assert served.fake.calls_of(model_id) == [("forward_backward", (10,)), ("forward_backward", (20,)),
                                              ("forward_backward", (30,))]
    # seq_id 4 never comes: seq_id 5 gives up after serve.seq_gap_timeout_s (1 s here)
    gap = _retrieve(served.url, _post_forward_backward(served.url, model_id, 5, 50)).json()
    assert gap["category"] == "server" and "seq_id 4" in gap["error"] and "never arrived" in gap["error"]
    late = _retrieve(served.url, _post_forward_backward(served.url, model_id, 4, 40)).json()
    assert late["category"] == "server" and "after seq_id 5" in late["error"]


def test_bad_requests_fail_as_user_errors_and_the_server_keeps_serving(service, served):
    tc = service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    assert "unknown loss_fn 'dpo'" in sdk_user_error(tc.forward_backward([ce_datum([1, 2, 3])], "dpo"))
    bad_csr = T.TensorData(data=[1.0], dtype="float32", shape=[2, 3], sparse_crow_indices=[0, 1, 5],
                           sparse_col_indices=[7])
    malformed = T.Datum(model_input=T.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3]), "weights": bad_csr})
    assert "malformed sparse CSR tensor" in sdk_user_error(tc.forward_backward([malformed], "cross_entropy"))
    short = T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": np.array([2, 3]), "weights": np.array([1.0, 1.0])})
    assert "expected first dim 3 (= model_input.length)" in sdk_user_error(tc.forward_backward([short], "cross_entropy"))
    assert "unknown base_model 'no/such-model'" in sdk_user_error(
        service.create_lora_training_client("no/such-model", rank=1))
    # the same client goes on, in order
    ok = tc.forward_backward([ce_datum([7, 8, 9])], "cross_entropy").result(timeout=30)
    np.testing.assert_array_equal(ok.loss_fn_outputs[0]["logprobs"].data, expected_logprobs(ce_datum([7, 8, 9]), 0.0))


def test_leaving_the_service_client_finishes_its_session(served):
    with tinker.ServiceClient(base_url=served.url) as client:
        tc = client.create_lora_training_client("fake-model", rank=1).result(timeout=30)
        session_id = client.holder.get_session_id()
    assert _eventually(lambda: served.fake.calls_of(tc.model_id)[-1:] == [("close", ())])
    heartbeat = httpx.post(f"{served.url}/api/v1/session_heartbeat", json={"session_id": session_id}, timeout=30)
    assert heartbeat.status_code == 410


def test_a_session_without_heartbeats_is_finished():
    async def scenario() -> tuple[list, bool]:
        fake = FakeService()
        server = TinkerServer(fake, ServeConfig(session_timeout_s=0.2),
                              ModelCatalogue(fake.get_server_capabilities(), {}, None))
        session_id = server.create_session(OPEN_TENANT)["session_id"]
        request_id, model_id = server.training.create(session_id, 0, LoraSpec("fake-model", 1))
        assert await server.futures.wait(request_id, 5) == JsonResult({"model_id": model_id, "type": "create_model"})
        await asyncio.sleep(0.6)
        server.close()
        return fake, model_id, server.sessions[session_id].finished

    fake, model_id, finished = asyncio.run(scenario())
    assert finished and _eventually(lambda: fake.calls_of(model_id) == [("close", ())])


def test_aliases_must_name_served_models():
    with pytest.raises(ConfigError, match=r"serve.model_aliases.x: 'other' is not served"):
        build_app(FakeService("fake-model"), ServeConfig(model_aliases={"x": "other"}))


def test_wire_reads_sparse_csr_and_rejects_a_short_tensor():
    weights = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]])
    datum = T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": torch.tensor([2, 3, 4]), "weights": weights})
    assert datum.loss_fn_inputs["weights"].sparse_crow_indices is not None  # the SDK sent it sparse
    request = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(
        data=[datum], loss_fn="cross_entropy", loss_fn_config={"kl": 0.5, "mode": "x"}), model_id="m", seq_id=1)
    msg = forward_backward_request_to_proto(request)
    [decoded] = wire.datums(msg, ServeLimits())
    assert torch.equal(decoded.loss_fn_inputs["weights"], weights)
    assert decoded.loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert wire.loss_fn_config(msg) == {"kl": 0.5, "mode": "x"}
    msg.data[0].loss_fn_inputs["target_tokens"].shape[:] = [4]
    with pytest.raises(UserError, match=r"data\[0\]\.loss_fn_inputs\['target_tokens'\]: 3 values do not fill "
                                        r"shape \[4\]"):
        wire.datums(msg, ServeLimits())
    with pytest.raises(UserError, match="not a ForwardBackwardRequest"):
        wire.forward_backward_request(b"\xff\xff\xff", None, 1 << 20)
    assert wire.forward_backward_request(msg.SerializeToString(), None, 1 << 20).model_id == "m"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_meshrl_serve_runs_until_sigterm(tmp_path):
    """`meshrl serve` itself, with a keys file: it serves its key, refuses another, stops on
    SIGTERM, and its log names the keys file's counts but no key."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "serve.log"
    key, wrong_key = "tml-serve-test-5e1f", "tml-wrong-9c2d"
    (tmp_path / "keys.txt").write_text(f"{key} tester\n")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.cli", "serve",
                                 "serve.backend=meshrl.testing.fake_api:fake_service", "model.name_or_path=served-fake",
                                 f"serve.keys_file={tmp_path / 'keys.txt'}", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith(f"serving at http://127.0.0.1:{port}"), f"{line!r}\n{log.read_text()}"
        url = f"http://127.0.0.1:{port}"
        caps = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result(timeout=30)
        assert {"served-fake", ALIAS} <= {m.model_name for m in caps.supported_models}
        refused = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": wrong_key}, timeout=30)
        assert refused.status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        text = log.read_text()
        assert "serve.keys_file: 1 keys of 1 tenants" in text and key not in text and wrong_key not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
