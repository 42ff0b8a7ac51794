"""A process's GPU memory share: what the placement's bootstrap hands it and `claim_device` reads."""

import os

import torch

from meshrl.meshes.placement import VisibleDevices
from meshrl.training import gpu_budget


def test_the_bootstrap_hands_each_process_its_share_and_claim_device_caps_the_allocator(monkeypatch):
    import monarch.actor

    monkeypatch.setattr(monarch.actor, "current_rank", lambda: {"procs": 1})
    for name in (gpu_budget.MEMORY_FRACTION_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever the bootstrap sets
    assert gpu_budget.memory_fraction() is None
    VisibleDevices(("0", "3"), 0.45)()
    assert gpu_budget.memory_fraction() == 0.45
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    capped = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    assert gpu_budget.claim_device() == torch.device("cuda")
    assert capped == [(0.45, 0)]


def test_without_a_share_the_gpu_is_uncapped_and_a_cpu_host_computes_on_the_cpu(monkeypatch):
    monkeypatch.delenv(gpu_budget.MEMORY_FRACTION_ENV, raising=False)
    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_budget.claim_device() == torch.device("cuda") and capped == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(gpu_budget.MEMORY_FRACTION_ENV, "0.5")
    assert gpu_budget.claim_device() == torch.device("cpu") and capped == []
