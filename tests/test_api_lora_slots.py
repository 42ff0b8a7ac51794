"""`generator.lora_slots` for real: Monarch processes, the tiny model, vLLM applying each weight
version's adapter per request (multi-LoRA). Versions sample side by side with no weight load between
them, each under its own adapter; a version dropped from a replica's shelf is pulled again; an
adapter over the engine's rank fails its own requests only; a replaced generator pulls what it is
asked for."""

import os
import signal
import time

import psutil
import pytest
import torch

from meshrl.api import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, UserError
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig

from tests.test_api import API_RUN, _sl_data

pytestmark = [pytest.mark.monarch, pytest.mark.slow]  # a service of its own: ~30 s to start on 2 cores

PROMPT = ModelInput.from_ints([5, 17, 42, 9])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cfg = load_config(RunConfig, None, API_RUN + ["generator.lora_slots=2", "generator.lora_max_rank=16",
                                                  "serve.limits.max_lora_rank=16",
                                                  f"output.dir={tmp_path_factory.mktemp('api')}"])
    with ServiceClient(cfg) as svc:
        yield svc


def _trained(service, seed: int, rank: int = 4):
    client = service.create_lora_training_client(base_model="tiny", rank=rank, seed=seed, train_unembed=False)
    client.forward_backward(_sl_data(seed=seed), "cross_entropy")
    client.optim_step(AdamParams(learning_rate=5e-2)).result(timeout=120)
    return client


def _learner_logprobs(client, tokens: list[int]) -> torch.Tensor:
    [out] = client.forward([Datum.from_sequence(tokens, weights=[1.0] * len(tokens))]).result(timeout=120).loss_fn_outputs
    return out["logprobs"]


def _assert_matches_learner(sampler, client) -> None:
    """The engine's prompt logprobs under ``sampler``'s version are the learner's (bf16 engine)."""
    engine = sampler.compute_logprobs(PROMPT).result(timeout=120)
    learner = _learner_logprobs(client, PROMPT.to_ints())
    gap = (learner - torch.tensor(engine[1:])).abs().max()  # token i+1 given tokens 0..i
    assert gap < 0.05, gap


def _held(service) -> list[int]:
    """The versions the generator replica keeps on its shelf."""
    [info] = service.backend.session.meshes["generator"].info.call().get(timeout=60).values()
    return info["adapters"]


def test_each_version_samples_under_its_own_adapter_beside_the_others(service):
    a, b = _trained(service, seed=31), _trained(service, seed=32)
    sa, sb = a.save_weights_and_get_sampling_client("a1"), b.save_weights_and_get_sampling_client("b1")
    _assert_matches_learner(sa, a)
    _assert_matches_learner(sb, b)
    base = service.create_sampling_client(base_model="tiny").compute_logprobs(PROMPT).result(timeout=120)
    assert sa.compute_logprobs(PROMPT).result(timeout=120)[1:] != pytest.approx(base[1:], abs=1e-3)

    long_params = SamplingParams(max_tokens=160, seed=9)
    alone = sa.sample(PROMPT, 2, long_params, owner="a").result(timeout=300)
    finished = []
    long = sa.sample(PROMPT, 2, long_params, owner="a")
    long.add_done_callback(lambda _: finished.append("long"))
    time.sleep(0.3)
    short = sb.sample(PROMPT, 1, SamplingParams(max_tokens=2, seed=1), owner="b")
    short.add_done_callback(lambda _: finished.append("short"))
    assert len(short.result(timeout=300).sequences[0].tokens) <= 2
    assert [s.tokens for s in long.result(timeout=300).sequences] == [s.tokens for s in alone.sequences]
    assert finished == ["short", "long"]  # another version ran beside the long request, not after it


def test_a_version_dropped_from_the_shelf_is_pulled_again_and_a_rank_over_the_limit_fails_alone(service):
    first = _trained(service, seed=41)
    kept = first.save_weights_and_get_sampling_client("first")
    _assert_matches_learner(kept, first)
    version = kept.version
    for i in range(5):  # more versions than a replica keeps (2 * lora_slots): the first is dropped
        other = _trained(service, seed=50 + i)
        other.save_weights_and_get_sampling_client(f"other{i}").compute_logprobs(PROMPT).result(timeout=120)
    assert version not in _held(service) and len(_held(service)) == 4
    _assert_matches_learner(kept, first)
    assert version in _held(service)

    wide = _trained(service, seed=60, rank=32)  # over generator.lora_max_rank = 16
    with pytest.raises(UserError, match="rank 32 is over generator.lora_max_rank = 16"):
        wide.save_weights_and_get_sampling_client("wide").sample(PROMPT, 1, SamplingParams(max_tokens=2)).result(120)
    _assert_matches_learner(kept, first)  # the generator serves on


def test_a_replaced_generator_pulls_the_adapters_it_is_asked_for(service):
    """A generator killed between requests: the next request of a version finds the process dead,
    the generator is replaced (with no weight version to restore), and the replacement pulls that
    version's adapter and samples under it."""
    client = _trained(service, seed=71)
    sampler = client.save_weights_and_get_sampling_client("before-the-kill")
    _assert_matches_learner(sampler, client)
    [pid] = service.backend.session.meshes.pids["generator"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"generator {pid} still running"
        time.sleep(0.1)
    _assert_matches_learner(sampler, client)
    assert service.backend.session.meshes.pids["generator"] != [pid]
    assert [e["mesh"] for e in service.backend.session.supervisor.events] == ["generator"]
    assert _held(service) == [sampler.version]
