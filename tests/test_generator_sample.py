"""The Generator's per-request `sample` endpoint (answered through its response port) on real
Monarch processes with the HF engine (the tiny runs' backend; the vLLM engine's continuous
batching through the same endpoint is tested in tests/test_api.py): concurrent calls from many
threads all complete, each stamped with the version it was sampled with, a seed gives the same
tokens again, the prompt's scores come back, and a request the engine refuses fails at the caller
with its own error while the generator keeps serving."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from meshrl.engines import PromptScoring, SampleRequest

pytestmark = pytest.mark.monarch


def test_concurrent_sample_calls_on_the_hf_generator(tiny_run_config, tiny_session):
    from meshrl.controller.runtime import Runtime

    with Runtime(tiny_run_config(), session=tiny_session) as rt:
        request = SampleRequest(n=2, max_tokens=5, temperature=1.0, seed=7, topk=2)
        scoring = PromptScoring(logprobs=True, topk=1)
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: rt.client.sample([5, 6, 7 + i % 2], request, scoring), range(6)))
        assert [[c.tokens for c in r.completions] for r in results[0::2]] == \
            [[c.tokens for c in results[0].completions]] * 3  # same prompt, same seed
        for r in results:
            assert len(r.completions) == 2 and all(c.meta["version"] == 0 for c in r.completions)
            assert all(len(c.topk[0]) == len(c.tokens) for c in r.completions)
            assert len(r.prompt.logprobs) == 2 and len(r.prompt.topk[0]) == 2
        with pytest.raises(Exception, match="max_new_tokens"):
            rt.client.sample([5, 6], SampleRequest(n=1, max_tokens=0), PromptScoring())
        assert rt.client.sample([5, 6], SampleRequest(n=1, max_tokens=2, seed=1), PromptScoring()).completions
        assert rt.supervisor.events == []  # nothing was replaced
