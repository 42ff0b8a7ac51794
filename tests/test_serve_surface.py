"""The tinker 0.38 SDK's surface against `meshrl serve` (docs/tinker.md, "The SDK's surface"): each
call or option the server does not serve fails in one line that names it and an alternative, and
the calls and options served by this layer (checkpoint TTLs, overwrite, user metadata, custom losses
uploaded and run on the server or run client-side, sampler handles) do what the SDK documents. The
official SDK drives the app over the deterministic fake backend, served in a thread of this process."""

from __future__ import annotations

import asyncio
import math
import os
import time
import warnings
from datetime import datetime, timezone

import httpx
import numpy as np
import pytest
import torch

import tinker
from tinker import types as T
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase
from tinker.lib.public_interfaces.admin_client import AdminClient

from meshrl.api.errors import UserError
from meshrl.config.serve import ServeConfig, ServeLimits
from meshrl.serve.app import TinkerServer, build_app
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.custom_losses import CustomLosses
from meshrl.serve.futures import JsonResult
from meshrl.serve.tenants import OPEN_TENANT
from meshrl.serve.training import LoraSpec
from meshrl.testing.app_server import serve_in_thread
from meshrl.testing.fake_api import FakeService, fake_logprobs
from tests.conftest import sdk_user_error

os.environ.setdefault("TINKER_API_KEY", "tml-test")
os.environ["TINKER_TELEMETRY"] = "0"


def ce_datum(tokens: list[int]) -> T.Datum:
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                   loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                   "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


class Open:
    def __init__(self, url: str, fake: FakeService):
        self.url, self.fake = url, fake
        self.service = tinker.ServiceClient(base_url=url)
        self.rest = tinker.RestClient(base_url=url)
        self.tc = self.service.create_lora_training_client("fake-model", rank=2).result(timeout=30)
        self.state = self.tc.save_state("s0").result(timeout=30).path
        self.sampler = self.service.create_sampling_client(base_model="fake-model").result(timeout=30)


@pytest.fixture(scope="module")
def srv():
    fake = FakeService()
    with serve_in_thread(build_app(fake, ServeConfig(poll_hold_s=0.25))) as url:
        served = Open(url, fake)
        yield served
        served.service.close("success").result(timeout=30)


def refusal(call) -> str:
    """The message of a direct call the server refused with 400 (the SDK's BadRequestError)."""
    with pytest.raises(tinker.BadRequestError) as err:
        call().result(timeout=30)
    assert err.value.body["category"] == "user"
    message = err.value.body["error"]
    assert "\n" not in message
    return message


PROMPT = T.ModelInput.from_ints([4, 5, 6])
PARAMS = T.SamplingParams(max_tokens=2)


def test_topk_target_and_alternative_logprobs_are_served_in_the_sdks_format(srv):
    prompt = T.ModelInput.from_ints([4, 5, 6, 7])
    own = fake_logprobs([5, 6, 7], 0.0).tolist()
    ids = torch.tensor([[5, 9], [-1, 6], [7, -1]])
    response = srv.sampler.sample(prompt, 2, PARAMS, include_prompt_logprobs=True, topk_prompt_logprobs=2,
                                  topk_sample_logprobs=3, target_prompt_logprobs=T.TensorData.from_torch(ids),
                                  prompt_alt_tokens_k=2).result(timeout=30)
    assert response.prompt_logprobs[1:] == pytest.approx(own)
    assert response.topk_prompt_logprobs[0] is None
    for row, token, lp in zip(response.topk_prompt_logprobs[1:], [5, 6, 7], own):
        assert [t for t, _ in row] == [token, token + 1] and [v for _, v in row] == pytest.approx([lp, lp - 1])
    for seq in response.sequences:
        assert [[t for t, _ in row] for row in seq.topk_logprobs] == [[t, t + 1, t + 2] for t in seq.tokens]
        assert [row[0][1] for row in seq.topk_logprobs] == pytest.approx(seq.logprobs)
    targets = response.target_prompt_logprobs.to_torch()
    assert targets.dtype == torch.float32 and targets.shape == (3, 2)
    expected = torch.where(ids >= 0, -(1 + (7 * ids + torch.arange(3)[:, None]) % 13) / 8, torch.zeros(()))
    assert torch.allclose(targets, expected)
    assert targets[0, 0].item() == pytest.approx(own[0]) and targets[2, 0].item() == pytest.approx(own[2])
    alt = response.prompt_alt_tokens
    assert alt.tokens.to_torch().tolist() == [[6, 7], [7, 8], [8, 9]] and alt.tokens.dtype == "int64"
    drawn = alt.tokens.to_torch()
    assert torch.allclose(alt.logprobs.to_torch(), -(1 + (7 * drawn + torch.arange(3)[:, None]) % 13) / 8)
    # sparse ids come back in the same sparse layout; prompt_logprobs_last_n empties the top-k rows before it
    sparse = torch.full((3, 4), -1)
    sparse[2, 3] = 7
    request = T.TensorData.from_torch_sparse(sparse, pad_value=-1)
    assert request.sparse_crow_indices is not None
    last = srv.sampler.sample(prompt, 1, PARAMS, include_prompt_logprobs=True, topk_prompt_logprobs=1,
                              target_prompt_logprobs=request, prompt_logprobs_last_n=2).result(timeout=30)
    reply = last.target_prompt_logprobs
    assert (reply.sparse_crow_indices, reply.sparse_col_indices) == (request.sparse_crow_indices,
                                                                      request.sparse_col_indices)
    assert reply.to_torch()[2, 3].item() == pytest.approx(own[2]) and reply.to_torch().count_nonzero() == 1
    assert last.topk_prompt_logprobs[:2] == [None, None] and last.topk_prompt_logprobs[2][0][0] == 6


def test_inflight_sampling_clients_follow_the_newest_inflight_save(srv):
    tc = srv.service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        follower = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=30)
        snapshot = tc.save_weights_and_get_sampling_client().result(timeout=30)

        def logprobs(sampler) -> list[float]:
            return sampler.sample(PROMPT, 1, PARAMS).result(timeout=30).sequences[0].logprobs

        before = logprobs(follower)
        assert before == logprobs(snapshot) == pytest.approx(fake_logprobs([7, 8], 0.0).tolist())
        tc.forward_backward([ce_datum([1, 2, 3])], "cross_entropy")
        tc.optim_step(T.AdamParams(learning_rate=0.5)).result(timeout=30)
        assert logprobs(follower) == before  # not saved yet: still the first save's weights
        newer = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=30)
    assert logprobs(follower) == logprobs(newer) != before  # both follow the newest inflight save
    assert logprobs(snapshot) == before


def test_dimuon_is_served_and_fixed_when_a_client_is_created(srv):
    """DimuonOptimizerConfig at creation, DimuonParams at each step (the fake: m <- beta1 m +
    (1 - beta1) g, w -= lr sign(m)); AdamParams are refused there and DimuonParams on an AdamW
    client; a checkpoint restored with its optimizer keeps Dimuon, a weights-only one takes the
    optimizer it is given (AdamW by default)."""
    tc = srv.service.create_lora_training_client("fake-model", rank=1, optimizer=T.DimuonOptimizerConfig()).result(30)
    tc.forward_backward([ce_datum([3, 5, 8, 13])], "cross_entropy").result(timeout=30)  # gradient: 3 weights of 1
    assert tc.optim_step(T.DimuonParams(learning_rate=0.5, beta1=0.5)).result(timeout=30).metrics["grad:sum"] == 3.0
    out = tc.forward([ce_datum([3, 5, 8, 13])], "cross_entropy").result(timeout=30)  # m = 1.5 > 0: w = -0.5
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == fake_logprobs([5, 8, 13], -0.5).tolist()
    message = sdk_user_error(tc.optim_step(T.AdamParams(learning_rate=0.1)), timeout=30)
    assert "trains with 'dimuon', not with AdamParams" in message
    message = sdk_user_error(srv.tc.optim_step(T.DimuonParams(learning_rate=0.1)), timeout=30)
    assert "trains with 'adamw', not with DimuonParams" in message
    message = sdk_user_error(tc.optim_step(OptimParamsBase(type="sgd", learning_rate=0.1)), timeout=30)
    assert "optimizer 'sgd' is not served; pass AdamParams (AdamW) or DimuonParams (Dimuon)" in message

    path = tc.save_state("dimuon").result(timeout=30).path
    info = srv.rest.get_weights_info_by_tinker_path(path).result(timeout=30)
    assert info.optimizer_config.type == "dimuon"
    resumed = srv.service.create_training_client_from_state_with_optimizer(path).result(timeout=30)
    resumed.forward_backward([ce_datum([3, 5, 8, 13])], "cross_entropy").result(timeout=30)
    resumed.optim_step(T.DimuonParams(learning_rate=0.5)).result(timeout=30)
    weights_only = srv.service.create_training_client_from_state(path).result(timeout=30)
    assert "trains with 'adamw'" in sdk_user_error(weights_only.optim_step(T.DimuonParams(learning_rate=0.1)), 30)
    chosen = srv.service.create_training_client_from_state(path, optimizer=T.DimuonOptimizerConfig()).result(30)
    chosen.optim_step(T.DimuonParams(learning_rate=0.1)).result(timeout=30)


def test_other_optimizers_are_refused_naming_the_two(srv):
    message = refusal(lambda: srv.service.create_lora_training_client(
        "fake-model", rank=1, optimizer=OptimizerConfigBase(type="sgd")))
    assert "optimizer_config {'type': 'sgd'} is not served; use AdamOptimizerConfig (AdamW, the default) or " \
           "DimuonOptimizerConfig" in message
    session_id = srv.service.holder.get_session_id()
    reply = httpx.post(f"{srv.url}/api/v1/load_weights", timeout=30, json={
        "session_id": session_id, "model_seq_id": 901, "path": srv.state, "optimizer": True,
        "optimizer_config": {"type": "dimuon", "version": 1}})
    assert "optimizer_config cannot override the optimizer restored with its state" in reply.json()["error"]


def test_full_fine_tuning_is_refused(srv):
    session_id = srv.service.holder.get_session_id()
    reply = httpx.post(f"{srv.url}/api/v1/create_model", timeout=30,
                       json={"session_id": session_id, "model_seq_id": 900, "base_model": "fake-model"})
    assert reply.status_code == 400 and "full fine-tuning (no lora_config) is not served; use " \
                                      "create_lora_training_client" in reply.json()["error"]


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/weight:mean": weights.sum()}


def ppo_clip(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


def test_uploaded_custom_losses_run_on_the_server(srv):
    """create_custom_loss uploads the SDK's trace (client/config: custom_loss_server_side); with its
    handle, forward_backward_custom is one server call: the fake's learner interprets the graph on
    its logprobs (-(1 + (7 t + i) mod 13) / 8 - w) and its gradient d loss / d w reaches optim_step."""
    nll = srv.service.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result(timeout=30)
    ppo = srv.service.create_custom_loss(ppo_clip, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}).result(30)
    assert nll.loss_id and ppo.loss_id and nll.loss_id != ppo.loss_id
    tc = srv.service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    data = [ce_datum([3, 5, 8, 13]), ce_datum([2, 4])]
    data[0].loss_fn_inputs["weights"] = T.TensorData.from_numpy(np.array([1.0, 0.0, 2.0], dtype=np.float32))
    out = tc.forward_backward_custom(data, nll).result(timeout=30)
    # targets [5, 8, 13] at w = 0: -(1 + 35 % 13) / 8, -(1 + 57 % 13) / 8, -(1 + 93 % 13) / 8; [4]: -(1 + 2) / 8
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.25, -0.75, -0.375]
    loss = -(-1.25 * 1 + -0.375 * 2) - (-0.375 * 1)  # 2.0 + 0.375
    assert out.metrics["loss:sum"] == pytest.approx(loss) and out.metrics["custom/nll:sum"] == pytest.approx(loss)
    assert out.metrics["custom/weight:mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert [op for op, _ in srv.fake.calls_of(tc.model_id)] == ["forward_backward"]
    # d loss / d w = sum of the weights (every logprob moves by -w)
    assert tc.optim_step(T.AdamParams(learning_rate=0.125)).result(timeout=30).metrics["grad:sum"] == 4.0
    # now w = -0.125 * 4: the target logprobs rose by 0.5, ratios e^0.5 against logprobs taken at w = 0
    ppo_datum = T.Datum(model_input=T.ModelInput.from_ints([3, 5]), loss_fn_inputs={
        "target_tokens": np.array([5, 8], dtype=np.int64), "old_logprobs": np.array([-1.25, -0.75], np.float32),
        "advantages": np.array([1.0, -1.0], dtype=np.float32)})
    out = tc.forward_backward_custom([ppo_datum], ppo).result(timeout=30)
    ratio = math.exp(0.5)  # min(r A, clip(r, 0.8, 1.2) A): 1.2 for A = 1, -r for A = -1
    assert out.metrics["loss:sum"] == pytest.approx(-(1.2 * 1.0) - (ratio * -1.0), rel=1e-6)
    assert out.metrics["custom/ratio:mean"] == pytest.approx(ratio, rel=1e-6)


def test_uploaded_custom_losses_outside_the_allow_list_are_refused(srv):
    def noisy(logprobs, weights):
        loss = -(logprobs * weights * torch.randn_like(weights)).sum()
        return loss, {}

    with pytest.raises(tinker.BadRequestError) as err:
        srv.service.create_custom_loss(noisy, {"logprobs": 1, "weights": 1}).result(timeout=30)
    assert err.value.body["category"] == "user" and "\n" not in err.value.body["error"]
    assert "custom loss 'noisy': node 'randn_like' (call_function 'torch.randn_like'): function " \
           "'torch.randn_like' is not allowed" in err.value.body["error"]
    message = sdk_user_error(srv.tc.forward_backward([ce_datum([1, 2, 3])], "custom"), timeout=30)
    assert "loss_fn 'custom' takes loss_fn_config {'loss_id': ...} from ServiceClient.create_custom_loss" in message
    message = sdk_user_error(srv.tc.forward_backward([ce_datum([1, 2, 3])], "custom", {"loss_id": "s:loss:9"}), 30)
    assert "unknown custom loss 's:loss:9'" in message


def test_a_custom_loss_serves_only_its_own_session():
    losses = CustomLosses(ServeLimits())
    handle = trace_loss(weighted_nll, {"logprobs": 1, "weights": 1}, "alice")
    loss_id = losses.create(T.CreateCustomLossRequest(session_id="alice", custom_loss_seq_id=0, name=handle.name,
                                                      inputs=list(handle.inputs), graph=encode_graph(handle)))
    assert losses.config("alice", {"loss_id": loss_id}, [])["name"] == "weighted_nll"
    with pytest.raises(UserError, match=f"custom loss '{loss_id}' belongs to another session"):
        losses.config("bob", {"loss_id": loss_id}, [])
    losses.close_session("alice")
    with pytest.raises(UserError, match="unknown custom loss"):
        losses.config("alice", {"loss_id": loss_id}, [])


def test_callable_custom_losses_run_client_side(srv):
    """forward_backward_custom with a plain callable: the SDK runs a forward, the loss on the
    client, and a cross_entropy backward weighted by -dloss/dlogprobs."""
    def doubled_nll(data, logprobs_list):
        loss = sum(-2.0 * lp.sum() for lp in logprobs_list)
        return loss, {"doubled_nll": float(loss)}

    tc = srv.service.create_lora_training_client("fake-model", rank=1).result(timeout=30)
    out = tc.forward_backward_custom([ce_datum([3, 5, 8, 13])], doubled_nll).result(timeout=30)
    assert out.metrics["loss:sum"] == pytest.approx(float(-2.0 * fake_logprobs([5, 8, 13], 0.0).sum()), rel=1e-6)
    assert [op for op, _ in srv.fake.calls_of(tc.model_id)] == ["forward", "forward_backward"]
    # the backward's weights were 2 per token: the fake's gradient is their sum
    assert tc.optim_step(T.AdamParams(learning_rate=1.0)).result(timeout=30).metrics["grad:sum"] == 6.0


def test_cross_organisation_access_and_projects_are_refused(srv):
    message = refusal(lambda: srv.service.create_training_client_from_state(srv.state, weights_access_token="t"))
    assert "weights_access_token is not served" in message and "your own tenant" in message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        message = sdk_user_error(srv.tc.load_state(srv.state, weights_access_token="t"), timeout=30)
    assert "weights_access_token is not served" in message
    with pytest.raises(tinker.BadRequestError, match="project_id 'p1' is not served"):
        tinker.ServiceClient(base_url=srv.url, project_id="p1").create_lora_training_client(
            "fake-model", rank=1).result(timeout=30)
    assert "project_id is not served" in refusal(lambda: srv.rest.list_training_runs(project_id="p1"))


@pytest.mark.parametrize("call, names", [
    (lambda s: s.rest.copy_weights(s.state, destination_project_id="p"), "copy_weights is not served"),
    (lambda s: s.tc.save_weights_external("x"), "save_weights_external is not served"),
    (lambda s: s.rest.get_external_weights_urls(s.state.replace("/weights/", "/external_weights/")),
     "get_external_weights_urls is not served"),
    (lambda s: s.rest.publish_checkpoint_from_tinker_path(s.state), "publish_checkpoint_from_tinker_path"),
    (lambda s: s.rest.unpublish_checkpoint_from_tinker_path(s.state), "unpublish_checkpoint_from_tinker_path"),
    (lambda s: s.rest.assign_session_project(s.service.holder.get_session_id(), "p"), "assign_session_project"),
    (lambda s: s.rest.export_session_trace(s.service.holder.get_session_id()), "export_session_trace"),
    (lambda s: s.rest.search_sessions(T.SessionSearchRequest()), "search_sessions is not served; use"),
    (lambda s: AdminClient(base_url=s.url).get_audit_log(), "get_audit_log is not served"),
    (lambda s: AdminClient(base_url=s.url).get_billing_usage("2026-01-01", "2026-02-01"), "get_billing_usage"),
    (lambda s: AdminClient(base_url=s.url).get_current_checkpoint_storage_usage(), "list_user_checkpoints"),
])
@pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")
def test_unserved_rest_calls_are_refused_in_one_line(srv, call, names):
    assert names in refusal(lambda: call(srv))


@pytest.mark.parametrize("path, flag", [("join_sampling_session", "sample_join_sampling_session: false"),
                                        ("retrieve_futures", "sample_use_retrieve_futures: false"),
                                        ("auth/token", "pjwt_auth_enabled: false")])
def test_endpoints_the_client_config_turns_off_are_refused_naming_the_flag(srv, path, flag):
    config = httpx.post(f"{srv.url}/api/v1/client/config", json={"sdk_version": "0.38.0"}, timeout=30).json()
    assert config.get(flag.split(":")[0], False) is False
    reply = httpx.post(f"{srv.url}/api/v1/{path}", json={}, timeout=30)
    assert reply.status_code == 400 and flag in reply.json()["error"]


def test_save_overwrite_ttl_and_user_metadata(srv):
    tc = srv.service.create_lora_training_client("fake-model", rank=1, user_metadata={"run": "r1"}).result(30)
    path = tc.save_state("same", ttl_seconds=3600, user_metadata={"step": "1"}).result(timeout=30).path
    message = sdk_user_error(tc.save_state("same"), timeout=30)
    assert f"{path} exists; pass overwrite=True or another name" in message
    assert tc.save_state("same", overwrite=True).result(timeout=30).path == path
    [saved] = srv.rest.list_checkpoints(tc.model_id).result(timeout=30).checkpoints
    assert saved.expires_at is None and saved.user_metadata is None  # the overwrite's own settings
    tc.save_state("kept", ttl_seconds=3600, user_metadata={"step": "2"}).result(timeout=30)
    run = srv.rest.get_training_run(tc.model_id).result(timeout=30)
    assert run.user_metadata == {"run": "r1"} and run.last_checkpoint.checkpoint_id == "weights/kept"
    expires = run.last_checkpoint.expires_at
    assert run.last_checkpoint.user_metadata == {"step": "2"}
    assert 3500 < (expires - datetime.now(timezone.utc)).total_seconds() <= 3600
    srv.rest.set_checkpoint_ttl_from_tinker_path(run.last_checkpoint.tinker_path, None).result(timeout=30)
    assert srv.rest.get_training_run(tc.model_id).result(timeout=30).last_checkpoint.expires_at is None
    info = srv.rest.get_weights_info_by_tinker_path(path).result(timeout=30)
    assert (info.base_model, info.lora_rank, info.is_lora) == ("fake-model", 1, True)


def test_an_expired_checkpoint_is_deleted():
    async def scenario() -> tuple[FakeService, str, bool]:
        fake = FakeService()
        server = TinkerServer(fake, ServeConfig(session_timeout_s=0.2),
                              ModelCatalogue(fake.get_server_capabilities(), {}, None))
        session_id = server.create_session(OPEN_TENANT)["session_id"]
        request_id, model_id = server.training.create(session_id, 0, LoraSpec("fake-model", 1))
        await server.futures.wait(request_id, 5)
        saved = server.save_weights(T.SaveWeightsRequest(model_id=model_id, path="brief", seq_id=1, ttl_seconds=1))
        assert isinstance(await server.futures.wait(saved["request_id"], 5), JsonResult)
        path = f"tinker://{model_id}/weights/brief"
        listed_before = path in server.training.checkpoints and path in fake.checkpoints
        await asyncio.sleep(1.0)  # the TTL; a housekeeping round runs every 0.05 s here
        deadline = time.monotonic() + 10  # its deletion runs on the server's pool: slower on a loaded machine
        while (path in server.training.checkpoints or path in fake.checkpoints) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.close()
        return fake, path, listed_before and path not in server.training.checkpoints

    fake, path, forgotten = asyncio.run(scenario())
    assert forgotten and path not in fake.checkpoints


def test_sampler_handles_and_logprob_options_are_served(srv):
    handle = srv.sampler.get_sampler_handle()
    clone = tinker.SamplingClient.from_sampler_handle(handle)
    assert clone.sample(PROMPT, 1, PARAMS).result(timeout=30).sequences[0].tokens == [7, 8]
    last = srv.sampler.compute_logprobs(T.ModelInput.from_ints([4, 5, 6, 7]), prompt_logprobs_last_n=2).result(30)
    assert last[:2] == [None, None] and last[2:] == pytest.approx(fake_logprobs([5, 6, 7], 0.0)[1:].tolist())
    image = T.ModelInput(chunks=[T.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=1)])
    message = sdk_user_error(srv.sampler.sample(image, 1, PARAMS), timeout=30)
    assert "image chunk; only encoded_text is supported" in message



def test_a_tenants_finished_sessions_are_forgotten_past_the_limit_unless_they_own_a_checkpoint():
    async def scenario() -> tuple[TinkerServer, list[str], str, str]:
        fake = FakeService()
        server = TinkerServer(fake, ServeConfig(limits=ServeLimits(max_finished_sessions_per_tenant=2)),
                              ModelCatalogue(fake.get_server_capabilities(), {}, None))
        other = server.create_session("other")["session_id"]
        server.finish_session(other)
        sessions, saver, kept_model = [], "", ""
        for n in range(40):
            session_id = server.create_session(OPEN_TENANT, user_metadata={"n": str(n)})["session_id"]
            request_id, model_id = server.training.create(session_id, 0, LoraSpec("fake-model", 1))
            await server.futures.wait(request_id, 5)
            if n == 1:  # this session saves a checkpoint: it owns it, so it is kept
                saved = server.save_weights(T.SaveWeightsRequest(model_id=model_id, path="keep", seq_id=1))
                assert isinstance(await server.futures.wait(saved["request_id"], 5), JsonResult)
                saver, kept_model = session_id, model_id
            server.finish_session(session_id)
            sessions.append(session_id)
        server.close()
        return server, sessions, saver, kept_model

    server, sessions, saver, kept_model = asyncio.run(scenario())
    mine = [sid for sid, s in server.sessions.items() if s.tenant == OPEN_TENANT]
    # two finished sessions kept: the checkpoint's owner (never forgotten) and the newest
    assert mine == [saver, sessions[-1]]
    assert {run.session_id for run in server.training.runs.values()} == {saver, sessions[-1]}
    assert server.owner("path", f"tinker://{kept_model}/weights/keep") == OPEN_TENANT
    assert [s.tenant for s in server.sessions.values()].count("other") == 1  # another tenant's are its own
    with pytest.raises(UserError, match="unknown session_id"):
        server.get_session(sessions[0])
