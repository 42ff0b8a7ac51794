"""Dimuon (meshrl.training.optimizers), Tinker's second optimizer: Jordan's quintic Newton-Schulz
iteration acts on a matrix's singular values as the scalar polynomial does (hand-computed for a
2x2 matrix, rotated, transposed), the step direction has Frobenius norm sqrt(rank), the optimizer
keeps an EMA momentum; a LoRA adapter created with it in the tiny model's learner steps exactly by
that rule, refuses AdamParams, and saves and loads its optimizer with its kind."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.optimizers import (NS_COEFFICIENTS, Dimuon, dimuon_direction, make_optimizer, newton_schulz,
                                        set_step_params)
from meshrl.training.policy import PolicyTrainer
from meshrl.types import AdamParams, Datum, DimuonParams


def _scalar_ns(x: float, steps: int = 5) -> float:
    """The quintic on one singular value: x <- a x + b x^3 + c x^5."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def _rotation(degrees: float) -> torch.Tensor:
    t = math.radians(degrees)
    return torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])


def test_one_newton_schulz_step_by_hand():
    # diag(0.6, 0.8) has Frobenius norm 1: 3.4445 * 0.6 - 4.7750 * 0.216 + 2.0315 * 0.07776 = 1.19326944,
    # 3.4445 * 0.8 - 4.7750 * 0.512 + 2.0315 * 0.32768 = 0.97648192
    out = newton_schulz(torch.diag(torch.tensor([0.6, 0.8])), steps=1)
    torch.testing.assert_close(out, torch.diag(torch.tensor([1.19326944, 0.97648192])), rtol=1e-6, atol=1e-6)


def test_the_direction_maps_singular_values_through_the_quintic_and_has_norm_sqrt_rank():
    g = torch.diag(torch.tensor([3.0, 4.0]))  # singular values / |g|_F = 0.6, 0.8
    o = torch.tensor([_scalar_ns(0.6), _scalar_ns(0.8)])
    expected = torch.diag(o * math.sqrt(2) / o.norm())
    torch.testing.assert_close(dimuon_direction(g), expected, rtol=1e-5, atol=1e-6)
    u, v = _rotation(30), _rotation(45)  # the same singular values, other singular vectors
    torch.testing.assert_close(dimuon_direction(u @ g @ v.T), u @ expected @ v.T, rtol=1e-5, atol=1e-5)
    wide = torch.randn(2, 7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(dimuon_direction(wide.T), dimuon_direction(wide).T)
    assert float(dimuon_direction(wide).norm()) == pytest.approx(math.sqrt(2), rel=1e-5)
    assert torch.equal(dimuon_direction(torch.zeros(3, 4)), torch.zeros(3, 4))


def test_the_optimizer_keeps_an_ema_momentum():
    p = torch.nn.Parameter(torch.eye(2))
    opt = Dimuon([p], lr=0.1, beta1=0.9)
    p.grad = torch.diag(torch.tensor([3.0, 4.0]))
    opt.step()
    step = 0.1 * dimuon_direction(torch.diag(torch.tensor([3.0, 4.0])))  # M = 0.1 g: the same direction
    torch.testing.assert_close(p.detach(), torch.eye(2) - step)
    torch.testing.assert_close(opt.state[p]["momentum"], torch.diag(torch.tensor([0.3, 0.4])))
    p.grad = torch.zeros(2, 2)  # M = 0.9 M: still moving the same way
    opt.step()
    torch.testing.assert_close(p.detach(), torch.eye(2) - 2 * step)
    torch.testing.assert_close(opt.state[p]["momentum"], torch.diag(torch.tensor([0.27, 0.36])))


def test_step_parameters_must_be_the_optimizers_own():
    dimuon = make_optimizer("dimuon", [torch.nn.Parameter(torch.zeros(2, 2))], {})
    with pytest.raises(ValueError, match="this optimizer is 'dimuon' .* pass DimuonParams, not AdamParams"):
        set_step_params(dimuon, AdamParams())
    adamw = make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2))], {"lr": 1e-3})
    with pytest.raises(ValueError, match="this optimizer is 'adamw' .* pass AdamParams, not DimuonParams"):
        set_step_params(adamw, DimuonParams(learning_rate=0.1))
    set_step_params(dimuon, DimuonParams(learning_rate=0.25, beta1=0.5))
    assert dimuon.param_groups[0]["lr"] == 0.25 and dimuon.param_groups[0]["beta1"] == 0.5
    with pytest.raises(ValueError, match="optimizer 'sgd': expected one of adamw, dimuon"):
        make_optimizer("sgd", [], {})
    with pytest.raises(ValueError, match="Dimuon updates matrices"):
        Dimuon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="beta1 must be in"):
        DimuonParams(learning_rate=0.1, beta1=1.0)


def _datums() -> list[Datum]:
    g = torch.Generator().manual_seed(4)
    return [Datum.from_sequence(torch.randint(3, 400, (10,), generator=g).tolist(), weights=[0.0] * 4 + [1.0] * 6)
            for _ in range(2)]


def test_a_dimuon_adapter_steps_by_the_rule_and_saves_its_optimizer(tmp_path):
    cfg = LearnerConfig(torch_threads=1, autocast_bf16=False, lora={"enabled": True, "rank": 2})
    trainer = PolicyTrainer(resolve_model("tiny"), cfg)
    tenants = trainer.tenants
    tenants.add("mu", rank=2, seed=1, optimizer="dimuon")
    tenants.use("mu")
    params = tenants.parameters("mu")
    trainer.forward_backward(_datums(), "cross_entropy")
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="pass DimuonParams, not AdamParams"):
        trainer.optim_step(AdamParams(learning_rate=0.01))
    trainer.optim_step(DimuonParams(learning_rate=0.01, beta1=0.9))
    for p, p0, g in zip(params, before, grads, strict=True):  # W - lr * direction(0.1 g)
        torch.testing.assert_close(p.detach(), p0 - 0.01 * dimuon_direction(0.1 * g), rtol=1e-5, atol=1e-7)
    moved = [float((p.detach() - p0).norm()) for p, p0 in zip(params, before)]
    assert all(m == pytest.approx(0.01 * math.sqrt(2), rel=1e-4) for m, g in zip(moved, grads) if g.any())
    assert any(not g.any() for g in grads)  # LoRA's A gets no gradient while B is 0: it stays

    tenants.save("mu", tmp_path / "mu")
    assert json.loads((tmp_path / "mu" / "tenant.json").read_text())["optimizer"] == "dimuon"
    assert tenants.load("copy", tmp_path / "mu", with_optimizer=True)["optimizer_type"] == "dimuon"
    momenta = [tenants.states[n].optimizer.state_dict()["state"] for n in ("mu", "copy")]
    assert momenta[0].keys() == momenta[1].keys()
    for key in momenta[0]:
        torch.testing.assert_close(momenta[0][key]["momentum"], momenta[1][key]["momentum"])
    with pytest.raises(ValueError, match="its optimizer state is 'dimuon''s, not 'adamw'"):
        tenants.load("copy", tmp_path / "mu", with_optimizer=True, optimizer="adamw")
    assert tenants.load("copy", tmp_path / "mu", with_optimizer=False)["optimizer_type"] == "dimuon"  # its own
    assert tenants.load("fresh", tmp_path / "mu", with_optimizer=False)["optimizer_type"] == "adamw"
