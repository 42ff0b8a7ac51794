"""The HF engine's static-cache path and its seeded device sampler: hand-computed filtering, the
distribution it draws from, draws that depend on a row's seed only, the bucketed static path
against its eager twin on the tiny model, and the compiled sampler against the eager one."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import SampleRequest
from meshrl.engines.device_sampler import processed_logprobs, row_keys, sample_step, top_p_filter
from meshrl.engines.hf_engine import HFEngine
from meshrl.engines.hf_static import batch_bucket, row_seeds, width_bucket
from meshrl.models.provision import resolve_model


def test_buckets_round_rows_to_powers_of_two_and_widths_to_sixteen():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65, 256, 257, 600)] == [1, 2, 4, 8, 64, 128, 256, 512, 768]
    assert [width_bucket(w) for w in (1, 16, 17, 40)] == [16, 16, 32, 48]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs.log(), 0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.5 + 0.3
    assert top_p_filter(probs.log(), 0.1).isfinite().tolist() == [[True, False, False, False]]


def test_processed_logprobs_are_temperature_then_top_p_renormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    z = [math.exp(2.0 / 0.5), math.exp(1.0 / 0.5), math.exp(0.0)]
    expected = [math.log(v / sum(z)) for v in z]
    torch.testing.assert_close(processed_logprobs(logits, 0.5, 1.0), torch.tensor([expected]))
    nucleus = processed_logprobs(logits, 0.5, 0.8)  # p(top) = 0.867 reaches 0.8 alone
    assert nucleus[0, 0].item() == 0.0 and nucleus[0, 1:].isinf().all()


def test_draws_follow_the_processed_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 20000
    keys = row_keys(torch.arange(rows, dtype=torch.int64))
    tokens, chosen, _, _ = sample_step(probs.log().expand(rows, 4), keys, torch.tensor(0), 1.0, 1.0)
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert (freq - probs).abs().max() < 0.015
    torch.testing.assert_close(chosen, probs.log()[tokens])


def test_a_rows_draws_depend_on_its_seed_and_step_only():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    seeds = torch.tensor([11, 12, 13, 14, 15])
    together, _, _, _ = sample_step(logits, row_keys(seeds), torch.tensor(2), 1.0, 1.0)
    alone, _, _, _ = sample_step(logits[3:4], row_keys(seeds[3:4]), torch.tensor(2), 1.0, 1.0)
    assert together[3] == alone[0]
    steps = torch.stack([sample_step(logits[:1].expand(64, 300), row_keys(torch.full((64,), 7)), torch.tensor(s),
                                     1.0, 1.0)[0][0] for s in range(64)])
    others = sample_step(logits[:1].expand(64, 300), row_keys(torch.arange(64)), torch.tensor(0), 1.0, 1.0)[0]
    assert len(set(steps.tolist())) > 10 and len(set(others.tolist())) > 10  # fresh noise per step and per seed


def test_request_seeds_give_each_sample_of_each_prompt_its_own_row_seed():
    seeds = row_seeds(2, 3, 40, torch.Generator())
    assert seeds.tolist() == [40 << 20, (40 << 20) + 1, (40 << 20) + 2, 41 << 20, (41 << 20) + 1, (41 << 20) + 2]
    drawn = row_seeds(2, 3, None, torch.Generator().manual_seed(0))
    assert len(set(drawn.tolist())) == 6


@pytest.fixture(scope="module")
def engines():
    path = resolve_model("tiny")
    make = lambda mode: HFEngine(path, GeneratorConfig(torch_threads=1, hf_decode=mode), "float32", 256, seed=0)  # noqa: E731
    return make("static"), make("eager")


PROMPTS = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8]]


def test_greedy_static_decoding_equals_its_eager_twin(engines):
    static, eager = engines
    assert static.static and not eager.static
    request = SampleRequest(n=1, max_tokens=10, temperature=0.0, topk=2)
    for got, want in zip(static.generate(PROMPTS, request), eager.generate(PROMPTS, request)):
        assert got[0].tokens == want[0].tokens
        torch.testing.assert_close(torch.tensor(got[0].logprobs), torch.tensor(want[0].logprobs), rtol=0, atol=1e-4)
        assert got[0].topk[0] == want[0].topk[0]


def test_sampled_static_rows_keep_their_draws_in_any_batch_and_report_processed_logprobs(engines):
    static, eager = engines
    request = SampleRequest(n=2, max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    batched = static.generate(PROMPTS, request)  # 6 rows in a bucket of 8
    alone = static.generate(PROMPTS[1:2], SampleRequest(n=2, max_tokens=10, temperature=0.8, top_p=0.9, seed=6))
    assert [c.tokens for c in alone[0]] == [c.tokens for c in batched[1]]  # prompt 1 of seed 5 = prompt 0 of seed 6
    assert batched[0][0].tokens != batched[0][1].tokens or batched[0][0].tokens != batched[2][0].tokens
    for prompt, group in zip(PROMPTS, batched):
        for c in group:  # teacher-forced under the processed distribution, on the eager twin's weights
            seq = prompt + c.tokens
            with torch.no_grad():
                logits = eager.model(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1:-1]
            want = processed_logprobs(logits, 0.8, 0.9).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_the_compiled_sampler_draws_what_the_eager_one_draws():
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(3)) * 3
    keys = row_keys(torch.arange(8) * 1009)
    compiled = torch.compile(sample_step)
    for step, (temperature, top_p) in enumerate([(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)]):
        got = compiled(logits, keys, torch.tensor(step), temperature, top_p, 3)
        want = sample_step(logits, keys, torch.tensor(step), temperature, top_p, 3)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-5)
