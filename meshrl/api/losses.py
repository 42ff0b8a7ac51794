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
(`meshrl.serve.stability`); in process, the caller passes them.

`custom` is an uploaded custom loss: its `loss_fn_config` is the graph (`name`, `inputs`, `nodes`,
see `meshrl.losses.fx_graph`), which the registered loss `custom` interprets per datum."""

from __future__ import annotations

import math

import torch

from meshrl.api.errors import UserError
from meshrl.losses.fx_graph import POSITIONS, GraphError, GraphLoss, compile_graph
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
    if loss_fn == CUSTOM:
        return custom_call(loss_fn_config, data)
    if loss_fn not in REQUIRED:
        raise UserError(f"loss_fn {loss_fn!r} is not supported: use one of {sorted(REQUIRED)}, "
                        f"{CUSTOM!r} (an uploaded custom loss) or forward_backward_custom")
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


CUSTOM = "custom"
"""Tinker's name for an uploaded custom loss (and the registered loss that interprets it)."""


def custom_loss(loss_fn_config: dict | None) -> GraphLoss:
    """The checked graph of an uploaded custom loss (``loss_fn_config``: ``name``, ``inputs``,
    ``nodes``); UserError naming what is refused or malformed."""
    config = dict(loss_fn_config or {})
    unknown = sorted(set(config) - {"name", "inputs", "nodes"})
    if unknown or not {"name", "inputs", "nodes"} <= set(config):
        raise UserError(f"loss_fn_config for 'custom': expected the graph's name, inputs and nodes, got "
                        f"{sorted(config)}")
    try:
        return compile_graph(config["name"], config["inputs"], config["nodes"])
    except GraphError as e:
        raise UserError(str(e)) from None


def custom_call(loss_fn_config: dict | None, data: list[Datum]) -> tuple[list[Datum], dict]:
    """The datums and registry config that compute an uploaded custom loss on ``data``: each datum
    keeps its target tokens and the inputs the loss reads (each of its declared rank; a rank-0 input
    may arrive as one value), and gets `POSITIONS`. The loss is tried on every datum with zero
    logprobs first, so a refused graph, a missing or misshapen input, a loss that fails on the data's
    shapes or does not depend on the logprobs is a UserError before the learner runs it."""
    loss = custom_loss(loss_fn_config)
    if not data:
        raise UserError("data: no datums")
    datums = []
    for i, datum in enumerate(data):
        inputs = {"target_tokens": datum.loss_fn_inputs.get("target_tokens")}
        if inputs["target_tokens"] is None or inputs["target_tokens"].dim() != 1:
            raise UserError(f"data[{i}].loss_fn_inputs['target_tokens']: custom losses need one target token "
                            "per position (rank 1)")
        for name, rank in loss.inputs[1:]:
            tensor = datum.loss_fn_inputs.get(name)
            if tensor is None:
                raise UserError(f"data[{i}].loss_fn_inputs: custom loss {loss.name!r} reads {name!r}")
            if rank == 0 and tensor.numel() == 1:
                tensor = tensor.reshape(())
            elif rank == 1 and tensor.dim() == 0 and datum.length == 1:
                tensor = tensor.reshape(1)
            if tensor.dim() != rank:
                raise UserError(f"data[{i}].loss_fn_inputs[{name!r}] has rank {tensor.dim()}, but custom loss "
                                f"{loss.name!r} declared it with rank {rank}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise UserError(f"data[{i}].loss_fn_inputs[{name!r}]: not finite")
            inputs[name] = tensor
        inputs[POSITIONS] = torch.ones(datum.length)
        datums.append(Datum(datum.model_input, inputs))
    _try_on_zero_logprobs(loss, datums)
    return datums, {"name": loss.name, "inputs": [list(pair) for pair in loss.inputs],
                    "nodes": list(loss_fn_config["nodes"])}


def _try_on_zero_logprobs(loss: GraphLoss, datums: list[Datum]) -> None:
    for i, datum in enumerate(datums):
        logprobs = torch.zeros(datum.length, requires_grad=True)
        try:
            value, _ = loss(logprobs, *(datum.loss_fn_inputs[name] for name in loss.input_names))
        except GraphError as e:
            raise UserError(f"data[{i}]: {e}") from None
        if not value.requires_grad:
            raise UserError(f"custom loss {loss.name!r} does not depend on logprobs: it has nothing to train")


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
    counts, maxima for `*_max`, means otherwise (the learner's bookkeeping, `seconds` and
    `pass_share`, and the per-datum `logprobs` left out). Keys that already name their reduction
    (a custom loss's own metrics) are kept."""
    out = {}
    for name, value in metrics.items():
        if name in ("seconds", "pass_share", "tokens", "logprobs"):
            continue
        if ":" in name:
            out[name] = float(value)
            continue
        reduction = "sum" if name == "loss" or name.startswith("num_") else "max" if name.endswith("_max") else "mean"
        out[f"{name}:{reduction}"] = float(value)
    return out


def custom_metric_sums(metrics: dict[str, float], datums: int) -> dict[str, float]:
    """An uploaded custom loss's metrics as Tinker reduces them over the call's ``datums``: the
    learner reports each as a mean over the datums, so ``custom/<name>:sum`` ones are multiplied
    by their number."""
    return {name: value * datums if name.startswith("custom/") and name.endswith(":sum") else value
            for name, value in metrics.items()}
