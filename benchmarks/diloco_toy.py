"""A small deterministic supervised task for DiLoCo replicas (pure torch, no language model): a
student MLP regresses a fixed random teacher MLP (plus seeded label noise) from Gaussian inputs.

Everything is a function of ``seed``: the teacher, the student's initial weights (the same on
every replica, so the run's initial state does not depend on which replica publishes it), the
evaluation set, and each replica's data stream: batch ``step`` of replica ``i`` is drawn from a
generator seeded by ``(seed, i, step)``. Step ``s`` of `train_single` with ``streams = n`` trains
on the concatenation of the ``n`` replicas' batches ``s``, so it sees exactly the samples that
``n`` DiLoCo replicas see, synchronising every step instead of every H steps.

`run_replica` is the entry point an executor runs in each replica
(``benchmarks.diloco_toy:run_replica``); it returns a JSON-able dict.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from meshrl.config.diloco import DiLoCoConfig
from meshrl.diloco.sync import DiLoCoSync

log = logging.getLogger("meshrl.diloco")

DIM_IN, TEACHER_HIDDEN, STUDENT_HIDDEN = 16, 32, 64
NOISE_STD = 0.1
EVAL_SIZE = 2048


@torch.no_grad()
def _mlp(hidden: int, seed: int) -> nn.Module:
    """Two-layer tanh MLP with nn.Linear's default init distribution drawn from a generator of its
    own (the global RNG is shared by every thread of a process)."""
    model = nn.Sequential(nn.Linear(DIM_IN, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    g = torch.Generator().manual_seed(seed)
    for layer in (model[0], model[2]):
        bound = layer.in_features ** -0.5
        for p in (layer.weight, layer.bias):
            p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)
    return model


def make_teacher(seed: int = 0) -> nn.Module:
    teacher = _mlp(TEACHER_HIDDEN, 10_000 + seed)
    teacher.requires_grad_(False)
    return teacher


def make_student(seed: int = 0, hidden: int = STUDENT_HIDDEN) -> nn.Module:
    """The model every replica starts from (identical for a given seed; ``hidden`` sizes it)."""
    return _mlp(hidden, 20_000 + seed)


@torch.no_grad()
def make_batch(teacher: nn.Module, seed: int, stream: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of data stream ``stream`` (a replica id; -1 is the evaluation set)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + stream + 1) * 1_000_003) + step)
    x = torch.randn(size, DIM_IN, generator=g)
    return x, teacher(x) + NOISE_STD * torch.randn(size, 1, generator=g)


@torch.no_grad()
def eval_loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = data
    return float(nn.functional.mse_loss(model(x), y))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _setup(seed: int, lr: float, weight_decay: float, threads: int, hidden: int):
    torch.set_num_threads(threads)
    teacher, model = make_teacher(seed), make_student(seed, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return teacher, model, opt, make_batch(teacher, seed, -1, 0, EVAL_SIZE)


def train_single(steps: int, batch_size: int, lr: float, streams: int = 1, eval_every: int = 1, seed: int = 0,
                 weight_decay: float = 0.0, threads: int = 1, hidden: int = STUDENT_HIDDEN) -> dict:
    """One model, plain AdamW, ``steps`` steps on ``streams`` replicas' batches concatenated (the
    baseline a DiLoCo run of ``streams`` replicas is compared with); eval loss every ``eval_every``
    steps."""
    teacher, model, opt, evalset = _setup(seed, lr, weight_decay, threads, hidden)
    losses, evals = [], []
    for step in range(steps):
        batches = [make_batch(teacher, seed, i, step, batch_size) for i in range(streams)]
        losses.append(_train_step(model, opt, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
        if (step + 1) % eval_every == 0:
            evals.append(eval_loss(model, evalset))
    return {"losses": losses, "eval": evals, "steps": steps, "samples": steps * streams * batch_size}


def run_replica(replica_id: int, replicas: int, store_url: str, storage_options: dict | None = None,
                rounds: int = 5, inner_steps: int = 10, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                weight_decay: float = 0.0, threads: int = 1, hidden: int = STUDENT_HIDDEN, run_id: str = "supervised",
                **diloco) -> dict:
    """Train replica ``replica_id`` of ``replicas`` for ``rounds`` DiLoCo rounds of ``inner_steps``
    AdamW steps, synchronising through the store at ``store_url``; ``diloco`` are further
    DiLoCoConfig fields (quorum, outer_lr, straggler_wait_s, ...). Returns its losses, the eval
    loss and weights hash after every round, each round's report (compute_s besides the sync's
    upload/wait/download split) and its bytes exchanged."""
    cfg = DiLoCoConfig(enabled=True, store_url=store_url, storage_options=storage_options or {}, run_id=run_id,
                       replicas=replicas, replica_id=replica_id, inner_steps=inner_steps, **diloco)
    teacher, model, opt, evalset = _setup(seed, lr, weight_decay, threads, hidden)
    params = dict(model.named_parameters())
    sync = DiLoCoSync(cfg)
    try:
        joined = sync.join(params)
        losses, evals, hashes, reports = [], [], [], []
        while sync.round < rounds:
            r = sync.round  # rounds done so far: this round's batches follow them in the stream
            t0 = time.perf_counter()
            for k in range(cfg.inner_steps):
                x, y = make_batch(teacher, seed, replica_id, r * cfg.inner_steps + k, batch_size)
                losses.append(_train_step(model, opt, x, y))
            compute_s = time.perf_counter() - t0
            report = {**sync.sync(params), "compute_s": compute_s}
            evals.append(eval_loss(model, evalset))
            hashes.append(report["hash"])
            reports.append(report)
            print(f"replica {replica_id}: round {report['round']} done, participants {report['participants']}, "
                  f"eval {evals[-1]:.5f}, hash {report['hash'][:12]}", flush=True)
    finally:
        sync.store.close()
    return {"replica": replica_id, "params": sum(p.numel() for p in params.values()), "joined": joined,
            "losses": losses, "eval": evals, "hashes": hashes, "rounds": reports, "bytes": [r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in reports],
            "samples": len(losses) * batch_size}
