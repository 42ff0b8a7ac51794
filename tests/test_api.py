"""`meshrl.api` in process, for real: Monarch processes, the tiny model, the real vLLM engine.
One service (learner with LoRA tenants + one generator) is shared by the tests of this module."""

import os
import signal
import threading
import time

import pytest
import torch

from meshrl.api import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, UserError
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.losses import token_losses

pytestmark = [pytest.mark.monarch, pytest.mark.slow]  # a service of its own: ~45 s on 2 cores

API_RUN = ["model.name_or_path=tiny", "model.max_model_len=256", "generator.kv_cache_gib=1",
           "learner.lora.enabled=true", "learner.lora.sync=adapter", "learner.autocast_bf16=false",
           "weight_sync.keep_versions=8", "weight_sync.max_arenas=10"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cfg = load_config(RunConfig, None, API_RUN + [f"output.dir={tmp_path_factory.mktemp('api')}"])
    with ServiceClient(cfg) as svc:
        yield svc


def _sl_data(n=4, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n):
        tokens = torch.randint(3, 200, (length,), generator=g).tolist()
        weights = [0.0] * (length // 2) + [1.0] * (length - length // 2)
        data.append(Datum.from_sequence(tokens, weights=weights))
    return data


def _rl_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(3):
        tokens = torch.randint(3, 200, (10,), generator=g).tolist()
        logprobs = (-torch.rand(10, generator=g) * 3).tolist()
        advantages = [0.0] * 4 + [float(torch.randn(1, generator=g))] * 6
        data.append(Datum.from_sequence(tokens, logprobs=logprobs, advantages=advantages))
    return data


def test_supervised_loss_falls_and_back_to_back_calls_run_in_order(service):
    client = service.create_lora_training_client(base_model="tiny", rank=8, seed=0, train_unembed=False)
    data = _sl_data()
    losses = []
    for _ in range(4):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(AdamParams(learning_rate=1e-2))  # submitted before the first one finished
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        assert step.result(timeout=120)["lr"] == 1e-2
    assert losses[-1] < losses[0] - 0.5, losses
    out = client.forward_backward(data, "cross_entropy").result(timeout=120)
    assert [o["logprobs"].shape[0] for o in out.loss_fn_outputs] == [d.model_input.length for d in data]


def test_forward_backward_equals_the_core_losses_on_the_same_data(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=3, train_unembed=False)
    sl, rl = _sl_data(seed=5), _rl_data()
    logp = [o["logprobs"] for o in client.forward(sl).result(timeout=120).loss_fn_outputs]
    # forward runs the loss in the learner, and still returns every position's logprob, also where
    # the loss reads none (the prompt, weight 0)
    assert all(bool((lp != 0).all()) for lp in logp)
    expected_ce = -sum(float((d.loss_fn_inputs["weights"] * lp).sum()) for d, lp in zip(sl, logp))
    fb = client.forward_backward(sl, "cross_entropy").result(timeout=120)
    assert fb.metrics["loss:sum"] == pytest.approx(expected_ce, abs=1e-5)
    for o, lp in zip(fb.loss_fn_outputs, logp):  # both return every position's logprob, the same ones
        assert bool((o["logprobs"] != 0).all()) and torch.allclose(o["logprobs"], lp, atol=1e-5)

    rl_logp = [o["logprobs"] for o in client.forward(rl, "ppo").result(timeout=120).loss_fn_outputs]
    cat = lambda key: torch.cat([d.loss_fn_inputs[key] for d in rl])  # noqa: E731
    expected = token_losses.ppo(torch.cat(rl_logp), cat("logprobs"), cat("advantages"), mask=torch.ones(27),
                                eps_low=0.1, eps_high=0.3).metrics["loss"]
    got = client.forward_backward(rl, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}).result(timeout=120)
    assert got.metrics["loss:sum"] == pytest.approx(expected, abs=1e-5)
    client.optim_step(AdamParams(learning_rate=0.0)).result(timeout=120)  # clear the gradients


def test_samples_carry_logprobs_that_match_the_learner(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=1, train_unembed=False)
    client.forward_backward(_sl_data(seed=2), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)  # weights differ from the base
    sampler = client.save_weights_and_get_sampling_client("after-one-step")
    prompt = ModelInput.from_ints([5, 17, 42, 9])
    response = sampler.sample(prompt, 4, SamplingParams(max_tokens=8, seed=0), include_prompt_logprobs=True).result(120)
    assert len(response.sequences) == 4
    for seq in response.sequences:
        assert seq.stop_reason in ("stop", "length") and len(seq.tokens) == len(seq.logprobs) > 0
        full = prompt.to_ints() + seq.tokens
        [learner_lp] = [o["logprobs"] for o in client.forward([Datum.from_sequence(
            full, weights=[1.0] * len(full))]).result(timeout=120).loss_fn_outputs]
        gap = (learner_lp[-len(seq.tokens):] - torch.tensor(seq.logprobs)).abs().mean()
        assert gap < 0.05, gap  # bf16 engine vs fp32 learner
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == 4
    again = sampler.compute_logprobs(prompt).result(timeout=120)
    assert again[0] is None and again[1:] == pytest.approx(response.prompt_logprobs[1:], abs=1e-4)
    base = service.create_sampling_client(base_model="tiny").compute_logprobs(prompt).result(timeout=120)
    assert base[1:] != pytest.approx(again[1:], abs=1e-3)  # the base model is another version


def test_state_round_trips_adapter_and_optimizer_and_clients_do_not_mix(service):
    a = service.create_lora_training_client(base_model="tiny", rank=4, seed=7, train_unembed=False)
    b = service.create_lora_training_client(base_model="tiny", rank=8, seed=8, train_unembed=False)
    data, other = _sl_data(seed=11), _sl_data(seed=12)
    adam = AdamParams(learning_rate=1e-2)

    def step(client, d):
        client.forward_backward(d, "cross_entropy")
        return client.optim_step(adam)

    step(a, data).result(timeout=120)
    path = a.save_state("one").result(timeout=120)
    assert path == f"tinker://{a.model_id}/weights/one"
    before = [o["logprobs"] for o in a.forward(data).result(timeout=120).loss_fn_outputs]
    for _ in range(2):  # b trains in between: a must not notice
        step(b, other)
    step(a, data).result(timeout=120)
    after_two = [o["logprobs"] for o in a.forward(data).result(timeout=120).loss_fn_outputs]
    a.load_state_with_optimizer(path).result(timeout=120)
    restored = [o["logprobs"] for o in a.forward(data).result(timeout=120).loss_fn_outputs]
    assert all(torch.equal(x, y) for x, y in zip(before, restored))
    step(a, data).result(timeout=120)  # the same second step again, from the restored optimizer state
    again = [o["logprobs"] for o in a.forward(data).result(timeout=120).loss_fn_outputs]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(after_two, again))
    a.load_state(path).result(timeout=120)  # weights only: a fresh optimizer takes another first step
    step(a, data).result(timeout=120)
    fresh = [o["logprobs"] for o in a.forward(data).result(timeout=120).loss_fn_outputs]
    assert not all(torch.allclose(x, y, atol=1e-6) for x, y in zip(after_two, fresh))


def test_bad_requests_are_user_errors_and_the_service_keeps_serving(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=9, train_unembed=False)
    with pytest.raises(UserError, match="loss_fn 'no_such_loss' is not supported"):
        client.forward_backward(_sl_data(), "no_such_loss").result(timeout=120)
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs: 'cross_entropy' needs 'weights'"):
        client.forward_backward([Datum.from_sequence([1, 2, 3], logprobs=[0, 0, 0])], "cross_entropy").result(120)
    with pytest.raises(ValueError, match="expected first dim"):  # a malformed tensor never becomes a Datum
        Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(3)})
    with pytest.raises(UserError, match="base_model 'Qwen/Nope' is not served here"):
        service.create_lora_training_client(base_model="Qwen/Nope")
    with pytest.raises(UserError, match="no sampler weights saved under that path"):
        service.create_sampling_client(model_path="tinker://x/sampler_weights/none")
    assert client.forward_backward(_sl_data(), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0


def test_closing_a_training_client_frees_its_adapter(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=10, train_unembed=False)
    client.forward_backward(_sl_data(), "cross_entropy").result(timeout=120)  # its adapter is the active one

    def adapters():
        return service.backend.client.on_learners("info", supervised=False)["adapters"]

    assert client.adapter in adapters()
    client.close()
    assert client.adapter not in adapters()
    other = service.create_lora_training_client(base_model="tiny", rank=4, seed=11, train_unembed=False)
    assert other.forward_backward(_sl_data(), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0


def test_an_uploaded_custom_loss_trains_as_the_loss_it_restates(service):
    """A weighted NLL traced by the tinker SDK, run by the learner process as the loss `custom`:
    the same loss as `cross_entropy` on the same data, with and without gradients, and its own
    metrics reduced as Tinker reduces them."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    def weighted_nll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss, "custom/weight:mean": weights.sum()}

    handle = trace_loss(weighted_nll, {"logprobs": 1, "weights": 1}, "local")
    graph = {"name": handle.name, "inputs": [[i.name, i.rank] for i in handle.inputs],
             "nodes": encode_graph(handle).model_dump()["nodes"]}
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=13, train_unembed=False)
    data = _sl_data(n=3)
    reference = client.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    for call in (client.forward, client.forward_backward):
        metrics = call(data, "custom", graph).result(timeout=120).metrics
        assert metrics["loss:sum"] == pytest.approx(reference, rel=1e-5)
        assert metrics["custom/nll:sum"] == pytest.approx(reference, rel=1e-5)
        assert metrics["custom/weight:mean"] == pytest.approx(6.0)  # 6 answer tokens of weight 1 per datum
    client.close()


def test_train_unembed_on_a_tied_model_is_accepted_and_not_applied(service):
    """The tiny model ties its unembedding to its embedding: Tinker's default train_unembed=True
    trains the other modules (logged, counted); asking for the unembedding alone is refused."""
    assert service.ties_unembedding
    before = service.skipped["train_unembed"]
    client = service.create_lora_training_client(base_model="tiny", rank=2, seed=12)
    assert service.skipped["train_unembed"] == before + 1
    path = client.save_state("unembed").result(timeout=120)
    config = (service.checkpoint_dir(path) / "adapter_config.json").read_text()
    assert "q_proj" in config and "lm_head" not in config
    with pytest.raises(UserError, match="train_unembed cannot apply .* ties its unembedding to its embedding"):
        service.create_lora_training_client(base_model="tiny", rank=2, train_mlp=False, train_attn=False)
    client.close()


def test_requests_join_the_running_batch_and_keep_their_seeds(service):
    """Continuous batching on the real engine: a short request sent while a long one generates
    finishes first, and a request gives the same tokens alone and among requests with other seeds,
    temperatures, stop tokens and lengths."""
    sampler = service.create_sampling_client(base_model="tiny")
    prompt = ModelInput.from_ints([5, 17, 42, 9])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    alone = [s.tokens for s in sampler.sample(prompt, 3, params).result(timeout=120).sequences]
    finished = []  # the order in which the short and the long request completed
    long = sampler.sample(ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(max_tokens=240, seed=3))
    long.add_done_callback(lambda _: finished.append("long"))
    time.sleep(0.05)  # the long request is admitted (240 steps take about a second here)
    short = sampler.sample(prompt, 1, SamplingParams(max_tokens=2, seed=1))
    short.add_done_callback(lambda _: finished.append("short"))
    others = [sampler.sample(ModelInput.from_ints([8, 9, 10 + i]), 1 + i % 3,
                             SamplingParams(max_tokens=4 + 3 * i, temperature=0.5 + 0.2 * i, top_p=0.9, seed=100 + i,
                                            stop=[40 + i]))
              for i in range(6)]
    among = sampler.sample(prompt, 3, params)
    assert [s.tokens for s in among.result(timeout=120).sequences] == alone
    assert len(short.result(timeout=120).sequences[0].tokens) <= 2
    for i, other in enumerate(others):
        assert all(len(s.tokens) <= 4 + 3 * i for s in other.result(timeout=120).sequences)
    assert len(long.result(timeout=300).sequences[0].tokens) == 240
    assert finished == ["short", "long"]  # the short one did not wait for the long one


def test_a_version_switch_waits_for_the_running_requests(service):
    """Requests of another weight version wait until the running ones have finished: a long
    request of the base model samples exactly what it samples alone while a newer version's
    requests queue behind it, and those sample what they sample alone."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=21, train_unembed=False)
    client.forward_backward(_sl_data(seed=5), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)
    trained = client.save_weights_and_get_sampling_client("switch")
    base = service.create_sampling_client(base_model="tiny")
    prompt, long_params = ModelInput.from_ints([3, 4, 5]), SamplingParams(max_tokens=120, seed=7)
    short_params = SamplingParams(max_tokens=6, seed=8)
    long_alone = base.sample(prompt, 1, long_params).result(timeout=300).sequences[0]
    short_alone = trained.sample(prompt, 2, short_params).result(timeout=120).sequences
    long = base.sample(prompt, 1, long_params)
    time.sleep(0.5)
    short = trained.sample(prompt, 2, short_params)
    done_short = short.result(timeout=300)
    assert long.done()  # the newer version waited for the base model's request
    got = long.result().sequences[0]
    assert got.tokens == long_alone.tokens and got.logprobs == pytest.approx(long_alone.logprobs, abs=1e-5)
    assert [s.tokens for s in done_short.sequences] == [s.tokens for s in short_alone]


def test_an_owners_long_request_runs_in_chunks_and_another_owner_switches_in_between(service):
    """An owner's request is sampled in chunks (`serve.limits.sample_chunk_tokens`): a long seeded
    one gives the same tokens alone and beside another owner's request on another weight version,
    which finishes first: the version switches between two of the long request's chunks."""
    chunk = service.sampler.chunk_tokens
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=23, train_unembed=False)
    client.forward_backward(_sl_data(seed=6), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)
    trained = client.save_weights_and_get_sampling_client("chunks")
    base = service.create_sampling_client(base_model="tiny")
    prompt, long_params = ModelInput.from_ints([3, 4, 5]), SamplingParams(max_tokens=6 * chunk, seed=9)
    alone = base.sample(prompt, 2, long_params, include_prompt_logprobs=True, owner="a").result(timeout=300)
    assert all(len(s.tokens) == 6 * chunk if s.stop_reason == "length" else len(s.tokens) <= 6 * chunk
               for s in alone.sequences)
    assert alone.prompt_logprobs[0] is None and len(alone.prompt_logprobs) == 3
    finished = []
    long = base.sample(prompt, 2, long_params, include_prompt_logprobs=True, owner="a")
    long.add_done_callback(lambda _: finished.append("long"))
    time.sleep(0.3)  # the long request is running its first chunks
    short = trained.sample(prompt, 1, SamplingParams(max_tokens=2, seed=1), owner="b")
    short.add_done_callback(lambda _: finished.append("short"))
    assert len(short.result(timeout=300).sequences[0].tokens) <= 2
    among = long.result(timeout=300)
    assert [s.tokens for s in among.sequences] == [s.tokens for s in alone.sequences]
    assert finished == ["short", "long"]  # the other version did not wait for the whole long request


def test_an_owner_sampling_one_request_after_another_keeps_its_version_while_another_waits(service, monkeypatch):
    """Anticipation on the real engine: owner b samples one request after another from the base
    model while owner a's requests on its own weights wait; b's requests run with no weight load
    between them (each comes within `hold_s` of the last), then a's version loads once and all of
    a's requests run."""
    monkeypatch.setattr(service.sampler, "hold_s", 5.0)  # a loaded machine must not miss the moment
    monkeypatch.setattr(service.sampler, "turn_s", 60.0)
    loads = []
    hold = service.backend.hold
    monkeypatch.setattr(service.backend, "hold", lambda version: (loads.append(version), hold(version))[1])
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=29, train_unembed=False)
    client.forward_backward(_sl_data(seed=8), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)
    trained = client.save_weights_and_get_sampling_client("anticipation")
    base = service.create_sampling_client(base_model="tiny")
    prompt = ModelInput.from_ints([3, 4, 5])
    base.sample(prompt, 1, SamplingParams(max_tokens=2, seed=1), owner="b").result(timeout=300)
    before = list(loads)
    waiting = [trained.sample(prompt, 1, SamplingParams(max_tokens=8, seed=s), owner="a") for s in range(3)]
    for seed in range(2, 6):
        base.sample(prompt, 1, SamplingParams(max_tokens=2, seed=seed), owner="b").result(timeout=300)
    assert loads == before  # b's four requests ran on the version held, one after another
    assert not any(f.done() for f in waiting)
    assert all(len(f.result(timeout=300).sequences[0].tokens) <= 8 for f in waiting)
    assert len(loads) == len(before) + 1  # then a's version, once, for all three


def test_topk_target_and_alternative_prompt_logprobs_come_from_the_engine(service):
    sampler = service.create_sampling_client(base_model="tiny")
    tokens = [5, 17, 42, 9, 33, 8]
    prompt = ModelInput.from_ints(tokens)
    first = sampler.sample(prompt, 1, SamplingParams(max_tokens=4, seed=2), include_prompt_logprobs=True,
                           topk_prompt_logprobs=3, topk_sample_logprobs=2).result(timeout=120)
    own = first.prompt_logprobs[1:]
    assert first.prompt_logprobs[0] is None and first.topk_prompt_logprobs[0] is None
    best = [row[0][0] for row in first.topk_prompt_logprobs[1:]]
    for row, lp in zip(first.topk_prompt_logprobs[1:], own):
        values = [v for _, v in row]
        assert len(row) == 3 and values == sorted(values, reverse=True) and values[0] >= lp - 1e-5
    seq = first.sequences[0]
    for row, token, lp in zip(seq.topk_logprobs, seq.tokens, seq.logprobs):
        assert len(row) == 2 and row[0][1] >= row[1][1] and row[0][1] >= lp - 1e-5
        assert all(v == pytest.approx(lp, abs=1e-5) for t, v in row if t == token)
    ids = torch.tensor([[t, b, -1] for t, b in zip(tokens[1:], best)])
    second = sampler.sample(prompt, 1, SamplingParams(max_tokens=1, temperature=0.8, seed=4),
                            target_prompt_logprobs=ids, prompt_alt_tokens_k=4).result(timeout=120)
    targets = second.target_prompt_logprobs
    assert targets.shape == (5, 3) and targets[:, 2].eq(0).all()
    assert targets[:, 0].tolist() == pytest.approx(own, abs=1e-4)  # the prompt's own tokens
    assert targets[:, 1].tolist() == pytest.approx([row[0][1] for row in first.topk_prompt_logprobs[1:]], abs=1e-4)
    alt = second.prompt_alt_tokens
    assert alt.tokens.shape == alt.logprobs.shape == (5, 4) and alt.tokens.dtype == torch.int64
    # the drawn ids' logprobs are those of the full distribution: score them as targets
    rescored = sampler.sample(prompt, 1, SamplingParams(max_tokens=1), target_prompt_logprobs=alt.tokens).result(120)
    assert torch.allclose(rescored.target_prompt_logprobs, alt.logprobs, atol=1e-4)
    again = sampler.sample(prompt, 1, SamplingParams(max_tokens=1, temperature=0.8, seed=4),
                           prompt_alt_tokens_k=4).result(timeout=120)
    assert torch.equal(again.prompt_alt_tokens.tokens, alt.tokens)  # the draws follow the seed
    with pytest.raises(UserError, match=r"target_prompt_logprobs: expected \[len\(prompt\) - 1, K\] = \[5, K >= 1\]"):
        sampler.sample(prompt, 1, SamplingParams(max_tokens=1), target_prompt_logprobs=ids[:4]).result(timeout=120)
    with pytest.raises(UserError, match="at most 85 positions"):
        sampler.sample(ModelInput.from_ints(list(range(1, 101))), 1, SamplingParams(max_tokens=1),
                       prompt_alt_tokens_k=1).result(timeout=120)


def test_inflight_sampling_clients_follow_the_newest_inflight_save(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=23, train_unembed=False)
    follower = client.save_weights_and_get_sampling_client("inflight-1", kind="inflight")
    prompt = ModelInput.from_ints([5, 6, 7, 8])
    before = follower.compute_logprobs(prompt).result(timeout=120)
    client.forward_backward(_sl_data(seed=6), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)
    assert follower.compute_logprobs(prompt).result(timeout=120) == before  # nothing saved since
    newer = client.save_weights_and_get_sampling_client("inflight-2", kind="inflight")
    after = follower.compute_logprobs(prompt).result(timeout=120)
    assert after[1:] != pytest.approx(before[1:], abs=1e-4)
    assert after[1:] == pytest.approx(newer.compute_logprobs(prompt).result(timeout=120)[1:], abs=1e-5)


@pytest.mark.slow  # ~35 s with its teardown on 2 cores
def test_a_generator_killed_mid_sample_is_replaced_and_the_call_fails_alone(service):
    from meshrl.meshes.client import RequestLost

    sampler = service.create_sampling_client(base_model="tiny")
    params = SamplingParams(max_tokens=240, temperature=1.0, seed=3)
    sampler.sample(ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(max_tokens=2)).result(timeout=300)  # loaded
    [pid] = service.backend.session.meshes.pids["generator"]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(RequestLost, match="not issued again"):  # it may be what killed it
        sampler.sample(ModelInput.from_ints([5, 6, 7]), 8, params).result(timeout=300)
    assert service.backend.session.meshes.pids["generator"] != [pid]
    assert [e["mesh"] for e in service.backend.session.supervisor.events] == ["generator"]
    response = sampler.sample(ModelInput.from_ints([5, 6, 7]), 8, params).result(timeout=300)
    assert len(response.sequences) == 8  # the replacement serves the next request
    assert [e["mesh"] for e in service.backend.session.supervisor.events] == ["generator"]
