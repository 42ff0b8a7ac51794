"""Tinker's built-in losses in terms of meshrl's loss registry.

Tinker's losses are token-level and sum-reduced over every position of every datum, exactly what
`meshrl.losses` computes with a weight of 1 per position: the RL losses get ``mask = 1`` wherever
the datum has none (prompt positions carry advantage 0, so they add nothing, except to `dro`'s
penalty, which Tinker's formula applies at every position). Tinker's clip bounds are ratios
(`clip_low_threshold` 0.8, `clip_high_threshold` 1.2 for PPO and GSPO), meshrl's PPO and GSPO bounds
are distances from 1 (`eps_low`, `eps_high`); CISPO's are ratios in both. They come in
`loss_fn_config` or as per-datum inputs (equal across the batch). `dro` takes `beta` (0.05).

`stable_reinforce` reads the sampler's logprobs and a `mask` of the sampled positions: `meshrl
serve` fills both from what its samplers recorded for the sequences the datum's provenance names
(`meshrl.serve.stability`); in process, the caller passes them."""

from __future__ import annotations

import math

import torch

from meshrl.api.errors import UserError
from meshrl.types import Datum

REQUIRED = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages", "mask"),
}
"""The built-in losses and the `loss_fn_inputs` each needs."""

CLIPS = {"ppo": (0.8, 1.2), "gspo": (0.8, 1.2), "cispo": (0.0, 4.0)}
"""Default (clip_low_threshold, clip_high_threshold) ratios."""

THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")

DRO_BETA = 0.05
"""`dro`'s default `beta` (the value Tinker's documentation shows)."""


def core_call(loss_fn: str, loss_fn_config: dict | None, data: list[Datum]) -> tuple[list[Datum], dict]:
    """The datums and registry config that compute Tinker's ``loss_fn`` on ``data`` with
    `forward_backward(datums, loss_fn, config)`; UserError naming what is wrong."""
    if loss_fn not in REQUIRED:
        raise UserError(f"loss_fn {loss_fn!r} is not supported: use one of {sorted(REQUIRED)} "
                        "(or forward_backward_custom)")
    config = dict(loss_fn_config or {})
    known = set(THRESHOLDS) if loss_fn in CLIPS else {"beta"} if loss_fn == "dro" else set()
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserError(f"loss_fn_config for {loss_fn!r}: unknown key {unknown[0]!r}")
    if not data:
        raise UserError("data: no datums")
    for i, datum in enumerate(data):
        missing = [k for k in REQUIRED[loss_fn] if k not in datum.loss_fn_inputs]
        if missing:
            raise UserError(f"data[{i}].loss_fn_inputs: {loss_fn!r} needs {missing[0]!r}")
        for name, tensor in datum.loss_fn_inputs.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise UserError(f"data[{i}].loss_fn_inputs[{name!r}]: not finite")
    if loss_fn == "cross_entropy":
        return list(data), {}
    _check_positions(loss_fn, data)
    low, high = _thresholds(loss_fn, config, data)
    datums = [d if "mask" in d.loss_fn_inputs else
              Datum(d.model_input, {**d.loss_fn_inputs, "mask": torch.ones(d.model_input.length)}) for d in data]
    if loss_fn in ("ppo", "gspo"):
        return datums, {"eps_low": 1.0 - low, "eps_high": high - 1.0}
    if loss_fn == "cispo":
        return datums, {"clip_low": low, "clip_high": high}
    if loss_fn == "dro":
        beta = config.get("beta", DRO_BETA)
        if isinstance(beta, str) or not (math.isfinite(beta) and beta >= 0):
            raise UserError(f"loss_fn_config for 'dro': beta = {beta!r}; expected a number >= 0")
        return datums, {"beta": float(beta)}
    return datums, {}


def _check_positions(loss_fn: str, data: list[Datum]) -> None:
    """`gspo`: every datum's sequence ratio has a token; `stable_reinforce`: advantages only on the
    sampled positions (its `mask`)."""
    for i, datum in enumerate(data):
        inputs = datum.loss_fn_inputs
        if loss_fn == "gspo" and not bool((inputs["sequence_ratio_mask"] != 0).any()):
            raise UserError(f"data[{i}].loss_fn_inputs['sequence_ratio_mask'] marks no token: the sequence ratio "
                            "is a mean over the tokens it marks (the sampled tokens)")
        if loss_fn == "stable_reinforce" and bool(((inputs["advantages"] != 0) & (inputs["mask"] == 0)).any()):
            raise UserError(f"data[{i}]: stable_reinforce takes nonzero advantages only on sampled tokens")


def _thresholds(loss_fn: str, config: dict, data: list[Datum]) -> tuple[float, float]:
    if loss_fn not in CLIPS:
        return 0.0, 0.0
    values = []
    for key, default in zip(THRESHOLDS, CLIPS[loss_fn]):
        per_datum = {float(d.loss_fn_inputs[key].reshape(-1)[0]) for d in data if key in d.loss_fn_inputs}
        if len(per_datum) > 1:
            raise UserError(f"loss_fn_inputs[{key!r}] differs between datums: one value per batch")
        value = float(config.get(key, per_datum.pop() if per_datum else default))
        if not math.isfinite(value):
            raise UserError(f"{key} = {value}: not finite")
        values.append(value)
    low, high = values
    if loss_fn in ("ppo", "gspo") and not 0.0 < low <= 1.0 <= high:
        raise UserError(f"{loss_fn} needs 0 < clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
    if loss_fn == "cispo" and not 0.0 <= low <= high:
        raise UserError(f"cispo needs 0 <= clip_low_threshold <= clip_high_threshold, got {low}, {high}")
    return low, high


def metrics_with_reductions(metrics: dict[str, float]) -> dict[str, float]:
    """Core metrics keyed ``name:reduction`` as Tinker reports them: sums for the loss and token
    counts, maxima for `*_max`, means otherwise (learner bookkeeping such as `seconds`, and the
    per-datum `logprobs`, left out)."""
    out = {}
    for name, value in metrics.items():
        if name in ("seconds", "tokens", "logprobs"):
            continue
        reduction = "sum" if name == "loss" or name.startswith("num_") else "max" if name.endswith("_max") else "mean"
        out[f"{name}:{reduction}"] = float(value)
    return out
