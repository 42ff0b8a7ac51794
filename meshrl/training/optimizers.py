"""The learner's optimizers: AdamW, and Dimuon for LoRA matrices (Tinker's second optimizer).

Tinker fixes a training client's optimizer when it is created (`AdamOptimizerConfig` or
`DimuonOptimizerConfig`) and takes that optimizer's hyperparameters on every step (`AdamParams` or
`DimuonParams`). Tinker documents Dimuon only by its parameters: `learning_rate` "applied to a
direction with Frobenius norm sqrt(rank)", `beta1` the coefficient of a running average of the
gradients, `grad_clip_norm`, and an internal "matrix-sign iteration". meshrl's Dimuon is Muon
(Jordan et al. 2024, github.com/KellerJordan/Muon) on each LoRA matrix, scaled to that norm:

    M <- beta1 M + (1 - beta1) G                   (after clipping the global gradient norm)
    O  = NS5(M)                                    Newton-Schulz, Jordan's quintic, 5 steps
    W <- W - learning_rate * sqrt(r) * O / |O|_F   r = min(rows, cols): the LoRA rank of A and B

NS5 normalises M by its Frobenius norm (plus 1e-7) and iterates X <- a X + (b A + c A^2) X with
A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), on the wide orientation of M, in float32: it
maps each singular value s of M / |M|_F through the scalar polynomial x <- a x + b x^3 + c x^5 and
keeps the singular vectors, so O approximates the orthogonal factor U V^T (its singular values
land within about [0.7, 1.2]); the rescaling makes the step's size exact. A matrix whose momentum
is zero does not move. No Nesterov term and no weight decay (Tinker's DimuonParams has none).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from meshrl.types import AdamParams, DimuonParams

ADAMW, DIMUON = "adamw", "dimuon"
OPTIMIZERS = (ADAMW, DIMUON)
"""The optimizers a LoRA adapter can be created with (Tinker's `OptimizerConfig` types)."""

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Jordan's quintic Newton-Schulz iteration towards the orthogonal factor of a 2-D ``matrix``
    (float32; the input's shape)."""
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz: a matrix, got shape {tuple(matrix.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def dimuon_direction(momentum: torch.Tensor) -> torch.Tensor:
    """The step direction of one matrix: NS5 of its momentum rescaled to Frobenius norm
    sqrt(min(rows, cols)); zero for a zero momentum."""
    direction = newton_schulz(momentum)
    norm = direction.norm()
    if norm == 0:
        return torch.zeros_like(momentum)
    return (direction * (math.sqrt(min(momentum.shape)) / norm)).to(momentum.dtype)


class Dimuon(torch.optim.Optimizer):
    """Dimuon over 2-D parameters (LoRA matrices); `lr` and `beta1` per step as `DimuonParams`
    give them. State: each matrix's momentum."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-4, beta1: float = 0.9):
        params = list(params)
        flat = [tuple(p.shape) for p in params if p.dim() != 2]
        if flat:
            raise ValueError(f"Dimuon updates matrices; got parameters of shapes {flat[:3]}")
        super().__init__(params, {"lr": lr, "beta1": beta1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                momentum = state["momentum"]
                momentum.mul_(group["beta1"]).add_(p.grad, alpha=1 - group["beta1"])
                p.add_(dimuon_direction(momentum), alpha=-group["lr"])


def make_optimizer(kind: str, params: list[torch.nn.Parameter], adam_defaults: dict) -> torch.optim.Optimizer:
    """A fresh optimizer of ``kind`` over ``params`` (AdamW with ``adam_defaults``: lr, betas,
    eps, weight_decay); ValueError for an unknown kind."""
    if kind == ADAMW:
        return torch.optim.AdamW(params, **adam_defaults)
    if kind == DIMUON:
        return Dimuon(params)
    raise ValueError(f"optimizer {kind!r}: expected one of {', '.join(OPTIMIZERS)}")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return DIMUON if isinstance(optimizer, Dimuon) else ADAMW


def set_step_params(optimizer: torch.optim.Optimizer, params: AdamParams | DimuonParams) -> None:
    """Give every parameter group the step's hyperparameters; ValueError when they are another
    optimizer's (the optimizer is fixed when its adapter is created)."""
    kind = optimizer_kind(optimizer)
    wanted = DIMUON if isinstance(params, DimuonParams) else ADAMW
    if kind != wanted:
        expected = "DimuonParams" if kind == DIMUON else "AdamParams"
        raise ValueError(f"optim_step: this optimizer is {kind!r} (fixed when the adapter was created); pass "
                         f"{expected}, not {type(params).__name__}")
    for group in optimizer.param_groups:
        if kind == DIMUON:
            group.update(lr=params.learning_rate, beta1=params.beta1)
        else:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
