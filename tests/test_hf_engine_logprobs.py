"""The HF engine's logprobs are gathered on the device as generation goes, and `score` and
`topk_logprobs` are one batched forward on the device: all equal the former CPU computations
(the whole [samples, steps, vocab] score stack moved to the CPU, one forward per sequence) on the
tiny model in float32, to 1e-5."""

from __future__ import annotations

import pytest
import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import SampleRequest
from meshrl.engines.hf_engine import HFEngine
from meshrl.models.provision import resolve_model


@pytest.fixture(scope="module")
def engine():
    return HFEngine(resolve_model("tiny"), GeneratorConfig(torch_threads=1), "float32", 256, seed=0)


PROMPTS = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8]]


def _reference_generate(engine, prompts, request):
    """The former computation: generate's own warpers, output_scores, the stack on the CPU."""
    torch.manual_seed(request.seed)
    expanded = [p for p in prompts for _ in range(request.n)]
    width = max(len(p) for p in expanded)
    ids = torch.full((len(expanded), width), engine.pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(expanded):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    kwargs = dict(do_sample=False) if request.greedy else dict(
        do_sample=True, temperature=request.temperature, top_p=request.top_p, top_k=0)
    out = engine.model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=request.max_tokens,
                                eos_token_id=[engine.tokenizer.eos_token_id], pad_token_id=engine.pad_id,
                                return_dict_in_generate=True, output_scores=True, **kwargs)
    new = out.sequences[:, width:]
    scores = torch.stack(out.scores, dim=1).float().cpu()
    return new, torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_sampled_logprobs_equal_the_cpu_computation(engine, temperature, top_p):
    request = SampleRequest(n=2, max_tokens=12, temperature=temperature, top_p=top_p, seed=123)
    new, ref = _reference_generate(engine, PROMPTS, request)
    got = engine.generate(PROMPTS, request)
    flat = [c for group in got for c in group]
    assert len(flat) == len(new)
    for row, completion in enumerate(flat):
        n = len(completion.tokens)
        assert completion.tokens == new[row, :n].tolist()  # the same draws
        torch.testing.assert_close(torch.tensor(completion.logprobs), ref[row, :n], rtol=0, atol=1e-5)
        assert all(lp <= 0 for lp in completion.logprobs)


def test_batched_score_and_topk_equal_per_sequence_forwards(engine):
    seqs = [[1, 5, 9, 13, 2], [2, 7, 3], [3, 4, 5, 6, 7, 8, 9]]
    got = engine.score(seqs)
    for seq, lps in zip(seqs, got):
        ids = torch.tensor([seq])
        logits = engine.model(input_ids=ids).logits[0, :-1].float()
        ref = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert len(lps) == len(seq) - 1
        torch.testing.assert_close(torch.tensor(lps), ref, rtol=0, atol=1e-5)
    starts, lengths = [2, 1, 3], [3, 2, 4]
    for k in (0, 5):
        out = engine.topk_logprobs(seqs, starts, lengths, k)
        for seq, start, length, (indices, values, own) in zip(seqs, starts, lengths, out):
            logits = engine.model(input_ids=torch.tensor([seq])).logits[0, start - 1: start - 1 + length].float()
            ref = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(seq[start : start + length])[:, None]
            torch.testing.assert_close(own, ref.gather(-1, targets).squeeze(-1), rtol=0, atol=1e-5)
            if k == 0:
                assert indices is None
                torch.testing.assert_close(values, ref, rtol=0, atol=1e-5)
            else:
                ref_values, ref_indices = ref.topk(k, dim=-1)
                assert indices.dtype == torch.int32 and indices.tolist() == ref_indices.tolist()
                torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)
    assert engine.score([]) == []


def test_submit_samples_one_prompt_with_its_topk_and_prompt_scores(engine):
    """The HF engine's `submit` (batch-per-call, answered at once): its samples are `generate`'s for
    that prompt and seed, each sampled position's top-k comes from the distribution sampled from
    (the sampled token's own logprob among them when it is in the top-k), and the prompt's scores
    equal `score` and `topk_logprobs`."""
    from meshrl.engines.base import PromptScoring

    prompt = PROMPTS[2]
    request = SampleRequest(n=2, max_tokens=6, temperature=0.7, top_p=0.9, seed=5, topk=3)
    scoring = PromptScoring(logprobs=True, topk=2, targets=tuple((t, -1) for t in prompt[1:]), alt_k=2, alt_seed=1)
    sampled = engine.submit(prompt, request, scoring).result(timeout=0)
    again = engine.generate([prompt], request)[0]
    assert [c.tokens for c in sampled.completions] == [c.tokens for c in again]
    for c in sampled.completions:
        ids, values = c.topk
        assert len(ids) == len(c.tokens) and all(len(row) == 3 for row in ids)
        for row_ids, row_values, token, lp in zip(ids, values, c.tokens, c.logprobs):
            assert row_values == sorted(row_values, reverse=True) and row_values[0] >= lp - 1e-6
            if token in row_ids:
                assert row_values[row_ids.index(token)] == pytest.approx(lp, abs=1e-6)
    scores = sampled.prompt
    assert scores.logprobs == pytest.approx(engine.score([prompt])[0], abs=1e-5)
    assert [row[0] for row in scores.targets] == pytest.approx(scores.logprobs, abs=1e-6)
    assert all(row[1] == 0.0 for row in scores.targets)
    [(top_ids, top_values, _)] = engine.topk_logprobs([prompt], [1], [len(prompt) - 1], 2)
    assert scores.topk[0] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor(scores.topk[1]), top_values, rtol=0, atol=1e-5)
    assert len(scores.alt[0]) == len(prompt) - 1 and all(len(row) == 2 for row in scores.alt[0])
