"""Engine selection: vLLM tensor parallelism reaches the engine on CUDA hosts and is refused, in one
line naming the setting, with the HF backend or without CUDA."""

from pathlib import Path

import pytest
import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines import make_engine


@pytest.mark.parametrize("backend,cuda,where", [("hf", True, "the hf backend"), ("vllm", False, "a host without CUDA")])
def test_tensor_parallelism_is_refused_where_it_cannot_run(monkeypatch, backend, cuda, where):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match=rf"^generator.tensor_parallel_size = 2: .*not {where}$"):
        make_engine(Path("unused"), GeneratorConfig(backend=backend, tensor_parallel_size=2), "bfloat16", 256, 0)


def test_tensor_parallel_size_is_passed_to_vllm_on_a_cuda_host(monkeypatch):
    import vllm

    from meshrl.engines import vllm_engine

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(vllm_engine, "configure_vllm_environment", lambda cfg, replica: None)  # keep this process's env
    make_engine(Path("model"), GeneratorConfig(tensor_parallel_size=2), "bfloat16", 256, 0)
    assert seen["tensor_parallel_size"] == 2 and seen["model"] == "model"


def test_replicas_on_a_host_split_its_cores_under_auto_binding(monkeypatch):
    from meshrl.engines.vllm_engine import cpu_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    auto = GeneratorConfig()
    assert cpu_binding(auto, (0, 1)) == "auto"  # a lone engine keeps vLLM's choice
    assert [cpu_binding(auto, (r, 2)) for r in range(2)] == ["0,1", "2,3"]
    assert [cpu_binding(auto, (r, 3)) for r in range(3)] == ["0", "1", "2,3"]
    assert [cpu_binding(auto, (r, 8)) for r in range(5)] == ["0", "1", "2", "3", "0"]  # more replicas than cores
    assert cpu_binding(GeneratorConfig(omp_threads_bind="0-1"), (1, 2)) == "0-1"  # an explicit list is kept
