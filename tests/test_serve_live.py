"""`meshrl serve` for real, driven by the official, unmodified `tinker` SDK: a server subprocess
over real Monarch meshes (one learner with LoRA tenants, one vLLM generator, the tiny model), with
a keys file of two tenants (the tests use KEY; OTHER_KEY is the other tenant), stopped by its PID
at the end."""

from __future__ import annotations

import ast
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch

import tinker
from tinker import types as T

from meshrl.losses import dro, gspo, token_losses
from meshrl.testing.ports import free_port
from tests.conftest import sdk_user_error

pytestmark = [pytest.mark.monarch, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
ALIAS = "Qwen/Qwen3-4B-Instruct-2507"
KEY, OTHER_KEY = "tml-test", "tml-other-tenant-3c9e"
SERVE_TINY = ["model.name_or_path=tiny", "model.max_model_len=256", "generator.kv_cache_gib=1",
              "learner.autocast_bf16=false", "weight_sync.keep_versions=8", "weight_sync.max_arenas=10",
              "serve.limits.max_decompressed_bytes=4194304", "serve.limits.max_custom_loss_elements=10000"]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, pids: dict, log: Path):
        self.proc, self.url, self.pids, self.log = proc, url, pids, log


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    log = tmp / "server.log"
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY} tester\n{OTHER_KEY} other\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.cli", "serve", "-c", "configs/serve.yaml", *SERVE_TINY,
                                 f"output.dir={tmp}", f"serve.keys_file={keys}", "--port", str(port)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("serving at http://"), f"{line!r}\n{log.read_text()[-3000:]}"
        found = re.search(r"meshes ready in [0-9.]+s: (\{.*\})", log.read_text())
        yield Server(proc, f"http://127.0.0.1:{port}", ast.literal_eval(found[1]), log)
    finally:
        family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            for p in family:
                if p.is_running():
                    p.kill()


@pytest.fixture(scope="module")
def service(server):
    from meshrl.api import connect

    os.environ["TINKER_TELEMETRY"] = "0"
    with connect(server.url, api_key=KEY) as svc:  # the SDK's ServiceClient, attached
        yield svc


def ce_datum(tokens, weights=None) -> T.Datum:
    targets = tokens[1:]
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                   loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64),
                                   "weights": np.array(weights or [1.0] * len(targets), dtype=np.float32)})


def sl_data(seed: int, n: int = 4, length: int = 12) -> list[T.Datum]:
    g = np.random.default_rng(seed)
    return [ce_datum(g.integers(3, 200, length).tolist(), [0.0] * (length // 2) + [1.0] * (length - 1 - length // 2))
            for _ in range(n)]


def logprobs(out) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_capabilities_and_supervised_loss_falls_through_the_sdk(service):
    names = {m.model_name for m in service.get_server_capabilities().supported_models}
    assert {"tiny", ALIAS} <= names
    tc = service.create_lora_training_client(base_model=ALIAS, rank=8, seed=0)
    data = sl_data(0)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(T.AdamParams(learning_rate=1e-2))
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        step.result(timeout=120)
    assert losses[-1] < losses[0] - 0.5, losses


def test_values_through_the_server_equal_the_core_losses(service):
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=3)
    data = sl_data(5)
    lp = logprobs(tc.forward(data, "cross_entropy").result(timeout=120))
    expected = -sum(float((d.loss_fn_inputs["weights"].to_numpy() * x).sum()) for d, x in zip(data, lp))
    fb = tc.forward_backward(data, "cross_entropy").result(timeout=120)
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)  # float32 sums of ~200

    g = np.random.default_rng(1)
    rl = []
    for _ in range(3):
        tokens = g.integers(3, 200, 10).tolist()
        rl.append(T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": (-g.random(9) * 3).astype(np.float32),
            "advantages": np.array([0.0] * 3 + [float(g.normal())] * 6, dtype=np.float32)}))
    rl_lp = torch.tensor(np.concatenate(logprobs(tc.forward(rl, "ppo").result(timeout=120))))
    cat = lambda k: torch.tensor(np.concatenate([d.loss_fn_inputs[k].to_numpy() for d in rl]))  # noqa: E731
    core = token_losses.ppo(rl_lp, cat("logprobs"), cat("advantages"), mask=torch.ones(27), eps_low=0.2,
                            eps_high=0.2).metrics["loss"]
    got = tc.forward_backward(rl, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result(timeout=120)
    assert got.metrics["loss:sum"] == pytest.approx(core, rel=1e-5, abs=1e-5)
    tc.optim_step(T.AdamParams(learning_rate=0.0)).result(timeout=120)


def test_dro_gspo_and_stable_reinforce_through_the_server_equal_the_core_losses(service):
    """The cookbook's datums from a sampler that records stability info, trained with each of the
    SDK's other RL losses: the server's loss equals the registered loss on a forward's logprobs
    (stable_reinforce's sampler logprobs are the recorded ones the response carried)."""
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=5).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=120)
    prompt = [5, 17, 42, 9]
    resp = sampler.sample(T.ModelInput.from_ints(prompt), 3, T.SamplingParams(max_tokens=6, seed=1)).result(120)
    data = []
    for seq, advantage in zip(resp.sequences, [1.0, -0.5, 0.25]):
        tokens, n = prompt + list(seq.tokens), len(prompt) - 1
        reply = [0.0] * n + [1.0] * len(seq.tokens)
        datum = T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": np.array([0.0] * n + list(seq.logprobs), dtype=np.float32),
            "advantages": np.array(reply, dtype=np.float32) * advantage,
            "sequence_ratio_mask": np.array(reply, dtype=np.float32)})
        sid = seq.sequence_id
        data.append(datum.with_provenance(
            model_input=[T.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                         T.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
            loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n),
                            T.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))]))
    learner = logprobs(tc.forward(data, "stable_reinforce").result(timeout=120))
    def pad(rows):
        return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r) for r in rows], batch_first=True)

    lp = pad([x.copy() for x in learner])
    q, adv, reply = (pad([d.loss_fn_inputs[k].to_numpy().copy() for d in data])
                     for k in ("logprobs", "advantages", "sequence_ratio_mask"))
    real = pad([np.ones(d.model_input.length, dtype=np.float32) for d in data])  # 0 on the padding
    for loss_fn, config, core in (
            ("dro", {"beta": 0.1}, dro(lp, q, adv, real, beta=0.1)),
            ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
             gspo(lp, q, adv, real, ratio_mask=reply, eps_low=0.1, eps_high=0.1)),
            ("stable_reinforce", None, token_losses.cispo(lp, q, adv, reply, clip_low=0.0, clip_high=2.0))):
        got = tc.forward_backward(data, loss_fn, config).result(timeout=120).metrics["loss:sum"]
        assert got == pytest.approx(core.metrics["loss"], rel=1e-5, abs=1e-5), loss_fn
    tc.optim_step(T.AdamParams(learning_rate=0.0)).result(timeout=120)


def test_sampling_logprobs_match_a_learner_forward(service):
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=1)
    tc.forward_backward(sl_data(2), "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client("one-step")
    prompt = T.ModelInput.from_ints([5, 17, 42, 9])
    resp = sampler.sample(prompt, 3, T.SamplingParams(max_tokens=8, seed=0), include_prompt_logprobs=True).result(120)
    assert len(resp.sequences) == 3 and resp.prompt_logprobs[0] is None and len(resp.prompt_logprobs) == 4
    for seq in resp.sequences:
        full = [5, 17, 42, 9] + list(seq.tokens)
        [lp] = logprobs(tc.forward([ce_datum(full)], "cross_entropy").result(timeout=120))
        assert np.abs(lp[-len(seq.tokens):] - np.array(seq.logprobs)).mean() < 0.05


def test_logprob_options_seeds_and_inflight_clients_through_the_sdk(service):
    """Top-k, target and alternative prompt logprobs from the real engine in the SDK's format;
    concurrent requests with distinct seeds sample what each samples alone; an inflight sampling
    client follows its training client's newest inflight save."""
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=13)
    follower = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    tokens = [5, 17, 42, 9, 33]
    prompt = T.ModelInput.from_ints(tokens)
    ids = torch.tensor([[t, -1] for t in tokens[1:]])
    resp = follower.sample(prompt, 2, T.SamplingParams(max_tokens=4, seed=1), include_prompt_logprobs=True,
                           topk_prompt_logprobs=3, topk_sample_logprobs=2,
                           target_prompt_logprobs=T.TensorData.from_torch(ids), prompt_alt_tokens_k=2).result(120)
    own = resp.prompt_logprobs[1:]
    assert resp.topk_prompt_logprobs[0] is None and all(len(row) == 3 for row in resp.topk_prompt_logprobs[1:])
    assert all(len(row) == 2 for seq in resp.sequences for row in seq.topk_logprobs)
    targets = resp.target_prompt_logprobs.to_torch()
    assert targets.shape == (4, 2) and np.allclose(targets[:, 0].numpy(), own, atol=1e-4) and targets[:, 1].eq(0).all()
    alt = resp.prompt_alt_tokens
    assert alt.tokens.to_torch().shape == alt.logprobs.to_torch().shape == (4, 2)
    rescored = follower.sample(prompt, 1, T.SamplingParams(max_tokens=1),
                               target_prompt_logprobs=alt.tokens).result(120).target_prompt_logprobs.to_torch()
    assert torch.allclose(rescored, alt.logprobs.to_torch(), atol=1e-4)

    def tokens_of(seed: int) -> list[list[int]]:
        response = follower.sample(prompt, 2, T.SamplingParams(max_tokens=6, seed=seed)).result(120)
        return [list(s.tokens) for s in response.sequences]

    alone = {seed: tokens_of(seed) for seed in (1, 2)}
    together = [follower.sample(prompt, 2, T.SamplingParams(max_tokens=6, seed=seed, temperature=0.9 + seed / 10))
                for seed in range(3, 11)]
    together += [follower.sample(prompt, 2, T.SamplingParams(max_tokens=6, seed=seed)) for seed in (1, 2)]
    assert [[list(s.tokens) for s in f.result(120).sequences] for f in together[-2:]] == [alone[1], alone[2]]

    before = follower.compute_logprobs(prompt).result(120)
    tc.forward_backward(sl_data(4), "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=120)
    newer = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    after = follower.compute_logprobs(prompt).result(120)
    assert not np.allclose(after[1:], before[1:], atol=1e-4)
    assert np.allclose(after[1:], newer.compute_logprobs(prompt).result(120)[1:], atol=1e-5)


def test_state_round_trip_and_two_clients_do_not_mix(service):
    a = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=7)
    b = service.create_lora_training_client(base_model=ALIAS, rank=8, seed=8)
    data, other = sl_data(11), sl_data(12)

    def step(tc, d):
        tc.forward_backward(d, "cross_entropy")
        return tc.optim_step(T.AdamParams(learning_rate=1e-2))

    step(a, data).result(timeout=120)
    path = a.save_state("one").result(timeout=120).path
    before = logprobs(a.forward(data, "cross_entropy").result(timeout=120))
    step(b, other).result(timeout=120)  # another tenant trains in between
    step(a, data).result(timeout=120)
    after_two = logprobs(a.forward(data, "cross_entropy").result(timeout=120))
    a.load_state_with_optimizer(path).result(timeout=120)
    assert all(np.array_equal(x, y) for x, y in zip(before, logprobs(a.forward(data, "cross_entropy").result(120))))
    step(a, data).result(timeout=120)
    again = logprobs(a.forward(data, "cross_entropy").result(timeout=120))
    assert all(np.allclose(x, y, atol=1e-6) for x, y in zip(after_two, again))


def test_bad_requests_are_user_errors_and_the_server_keeps_serving(service, server):
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=9)
    assert "'dro' needs 'logprobs'" in sdk_user_error(tc.forward_backward(sl_data(0), "dro"))
    short = T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": np.array([1, 2], dtype=np.int64),
                                    "weights": np.ones(2, dtype=np.float32)})
    assert "expected first dim 3" in sdk_user_error(tc.forward_backward([short], "cross_entropy"))
    assert "Qwen/Nope" in sdk_user_error(service.create_lora_training_client(base_model="Qwen/Nope", rank=4))
    assert tc.forward_backward(sl_data(1), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
    assert server.proc.poll() is None


def test_a_hostile_tenant_restarts_nothing_and_the_other_keeps_working(service, server):
    """The other tenant sends what took the server down before: a seed past int64 (a vLLM step
    raised on it, and the generator was replaced until the restart budget ran out), a LoRA rank of a
    million (the learner was OOM-killed, and killed again by the request issued once more), token
    ids outside the vocabulary, a target-logprob shape of 20 M elements. Each is refused in one
    line, as the caller's error; this tenant samples and trains between them; no mesh restarts."""
    recoveries = server.log.read_text().count("recovering mesh")
    mine = service.create_sampling_client(base_model=ALIAS)
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=13)
    prompt = T.ModelInput.from_ints([5, 17, 42])
    hostile = tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY)

    def still_served():
        assert len(mine.sample(prompt, 2, T.SamplingParams(max_tokens=4, seed=1)).result(timeout=300).sequences) == 2
        assert tc.forward_backward(sl_data(5), "cross_entropy").result(timeout=300).metrics["loss:sum"] > 0

    try:
        theirs = hostile.create_sampling_client(base_model=ALIAS).result(timeout=300)
        for params in (T.SamplingParams(max_tokens=4, seed=2**64), T.SamplingParams(max_tokens=4, stop=[2**40])):
            with pytest.raises(tinker.BadRequestError, match="sampling_params"):
                theirs.sample(prompt, 1, params).result(timeout=300)
            still_served()
        with pytest.raises(tinker.BadRequestError, match="serve.limits.max_lora_rank"):
            hostile.create_lora_training_client(base_model=ALIAS, rank=1_000_000).result(timeout=300)
        message = sdk_user_error(theirs.sample(T.ModelInput.from_ints([5, 10**7]), 1, T.SamplingParams(max_tokens=4)))
        assert "prompt: token ids must lie in [0, " in message
        # a few hundred bytes declaring [2, 20 M] target ids (the SDK itself would send all 40 M)
        request = {"sampling_session_id": theirs._sampling_session_id, "seq_id": 99, "num_samples": 1,
                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]},
                   "sampling_params": {"max_tokens": 4},
                   "target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [2, 20_000_000]}}
        headers = {"X-API-Key": OTHER_KEY}
        sent = httpx.post(f"{server.url}/api/v1/asample", json=request, headers=headers, timeout=60)
        assert sent.status_code == 200, sent.text
        while (outcome := httpx.post(f"{server.url}/api/v1/retrieve_future", headers=headers, timeout=60,
                                     json={"request_id": sent.json()["request_id"]})).status_code == 408:
            pass
        assert outcome.json()["category"] == "user"
        assert "serve.limits.max_tensor_elements" in outcome.json()["error"]
        still_served()
    finally:
        hostile.close("success").result(timeout=120)
    assert server.log.read_text().count("recovering mesh") == recoveries  # no restart
    assert server.proc.poll() is None


def test_a_hostile_tenants_bombs_names_metadata_and_losses_are_refused_and_restart_nothing(service, server):
    """The rest of what a hostile tenant sends, on real meshes: a zstd bomb naming its own model
    (refused while inflating) and one naming this tenant's (refused before inflating), checkpoint
    names that climb out of their folder, oversized metadata, broken JSON, and a custom loss that
    grows as tokens to the fourth power (refused from its shapes before it runs, in forward and in
    forward_backward). Each is a one-line 4xx or `user` error; this tenant trains and samples
    between them; no mesh restarts."""
    import zstandard

    from tests.test_serve_limits import outer_power

    recoveries = server.log.read_text().count("recovering mesh")
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=21)
    mine = service.create_sampling_client(base_model=ALIAS)
    hostile = tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY)
    headers = {"X-API-Key": OTHER_KEY}

    def post(path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{server.url}/api/v1/{path}", headers=headers | kwargs.pop("headers", {}), timeout=120,
                          **kwargs)

    def refused(reply: httpx.Response, status: int, phrase: str) -> None:
        assert reply.status_code == status, reply.text
        assert reply.json()["category"] == "user" and "\n" not in reply.json()["error"]
        assert phrase in reply.json()["error"], reply.json()["error"]

    def still_served() -> None:
        assert tc.forward_backward(sl_data(7), "cross_entropy").result(timeout=300).metrics["loss:sum"] > 0
        assert len(mine.sample(T.ModelInput.from_ints([5, 17]), 1, T.SamplingParams(max_tokens=4, seed=3))
                   .result(timeout=300).sequences) == 1

    def bomb(model_id: str) -> bytes:  # model_id first, as the SDK writes it, then 64 MiB of zeros
        return zstandard.ZstdCompressor().compress(bytes([0x0A, len(model_id)]) + model_id.encode() + b"\0" * (64 << 20))

    try:
        theirs = hostile.create_lora_training_client(base_model=ALIAS, rank=4, seed=22).result(timeout=300)
        zstd = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
        refused(post("forward_backward", content=bomb(theirs.model_id), headers=zstd), 413,
                "serve.limits.max_decompressed_bytes")
        refused(post("forward_backward", content=bomb(tc.model_id), headers=zstd), 403, "belongs to another tenant")
        still_served()
        for name in (".", "..", "../escape", ".hidden"):
            refused(post("save_weights", json={"model_id": theirs.model_id, "path": name, "seq_id": 10**6}), 400,
                    "save_weights.path = ")
        refused(post("create_session", json={"tags": [], "sdk_version": "x", "user_metadata": {"blob": "x" * 20000}}),
                400, "serve.limits.max_metadata_bytes")
        refused(post("session_heartbeat", content=b"\xff\xfe{", headers={"Content-Type": "application/json"}), 400,
                "body is not JSON")
        power = hostile.create_custom_loss(outer_power, {"logprobs": 1, "weights": 1}).result(timeout=300)
        long_datum = [ce_datum(list(range(3, 15)))]  # 11 targets: 11**4 elements, over 10,000
        for reply in (theirs.forward_backward_custom(long_datum, power),
                      theirs.forward(long_datum, "custom", {"loss_id": power.loss_id})):  # forward-only too
            assert "serve.limits.max_custom_loss_elements" in sdk_user_error(reply)
        theirs.forward_backward_custom([ce_datum(list(range(3, 11)))], power).result(timeout=300)  # 7**4 fits
        still_served()
    finally:
        hostile.close("success").result(timeout=120)
    assert server.log.read_text().count("recovering mesh") == recoveries  # no restart
    assert server.proc.poll() is None


def test_keys_keep_tenants_apart_on_real_meshes(service, server):
    """Another tenant can neither load, sample nor delete this tenant's checkpoints; the owner's
    delete removes the files; an unknown key gets 401; the server's log holds no key."""
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=12)
    tc.forward_backward(sl_data(3), "cross_entropy")
    tc.optim_step(T.AdamParams(learning_rate=1e-2)).result(timeout=120)
    state = tc.save_state("kept-apart").result(timeout=120).path
    sampler_path = tc.save_weights_for_sampler("kept-apart-sampler").result(timeout=120).path
    other, rest_other = (tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY),
                         tinker.RestClient(base_url=server.url, api_key=OTHER_KEY))
    try:
        with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
            other.create_training_client_from_state(state).result(timeout=120)
        with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
            other.create_sampling_client(model_path=sampler_path).result(timeout=120)
        with pytest.raises(tinker.PermissionDeniedError, match="belongs to another tenant"):
            rest_other.delete_checkpoint_from_tinker_path(state).result(timeout=120)
        assert rest_other.list_user_checkpoints().result(timeout=120).checkpoints == []
    finally:
        other.close("success").result(timeout=120)
    [saved] = list(server.log.parent.rglob("kept-apart"))
    tinker.RestClient(base_url=server.url, api_key=KEY).delete_checkpoint_from_tinker_path(state).result(timeout=120)
    assert not saved.exists()
    with pytest.raises(tinker.AuthenticationError, match="unknown API key"):
        tinker.ServiceClient(base_url=server.url, api_key="tml-unknown-77").create_lora_training_client(
            base_model=ALIAS, rank=4).result(timeout=120)
    text = server.log.read_text()
    assert "serve.keys_file: 2 keys of 2 tenants" in text
    assert all(key not in text for key in (KEY, OTHER_KEY, "tml-unknown-77"))


def test_a_generator_killed_mid_sample_is_recovered_and_only_that_call_fails(service, server):
    sampler = service.create_sampling_client(base_model=ALIAS)
    [pid] = server.pids["generator"]
    prompt, params = T.ModelInput.from_ints([5, 6, 7]), T.SamplingParams(max_tokens=240, seed=3)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(tinker.RequestFailedError, match="not issued again") as err:  # it may be what killed it
        sampler.sample(prompt, 8, params).result(300)
    assert err.value.category == T.RequestErrorCategory.Server
    assert len(sampler.sample(prompt, 8, params).result(300).sequences) == 8  # the replacement serves
    assert "recovering mesh 'generator'" in server.log.read_text()


def test_the_sdk_rl_example_runs_against_the_server(server, monkeypatch):
    """examples/tinker_sdk_rl.py (the official SDK only), short, on the tiny model."""
    import importlib.util

    monkeypatch.setenv("TINKER_API_KEY", KEY)  # as its docstring says to run it

    spec = importlib.util.spec_from_file_location("tinker_sdk_rl", ROOT / "examples" / "tinker_sdk_rl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rewards = example.main(["--base-url", server.url, "--steps", "2", "--problems", "2", "--group", "2",
                            "--max-tokens", "8"])
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
