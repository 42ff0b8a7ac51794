"""A deterministic in-process backend for `meshrl serve` tests: the `meshrl.api` service contract
with arithmetic instead of a model.

The service serves one model and hands out training and sampling clients. A training client's
state is one float, its weight ``w`` (0 at creation): the log-probability of target token ``t`` at
position ``i`` is ``fake_logprobs`` — ``-(1 + (7 t + i) mod 13) / 8 - w`` in float32 — so tests
can predict every value the server returns. `forward_backward` accumulates a gradient (the sum of
``weights`` for cross_entropy, of ``advantages`` for the RL losses, whose value is
``-sum(exp(logprobs - datum logprobs) * advantages)``, the ratio clamped for ppo) that
`optim_step` applies as ``w -= learning_rate * gradient``; an uploaded custom loss (``custom``, its
graph in ``loss_fn_config``) is interpreted as the learner does (`meshrl.losses.fx_graph`) on those
logprobs, its gradient d loss / d w by autograd. A client created with ``optimizer='dimuon'`` takes
`DimuonParams` instead: the momentum ``m <- beta1 m + (1 - beta1) gradient``, then
``w -= learning_rate * sign(m)`` (Dimuon's step on a 1x1 matrix). Checkpoints store ``w`` (and, for the
optimizer, the step count and a momentum). Each training client executes its calls on one worker thread in submission
order, and every executed call is appended to `FakeService.calls` as
``(model_id, operation, first token of each datum)`` so tests can check the order the server
kept; `FakeService.delay_s` makes every training call take that long, and a training call that has
been recorded waits while `FakeService.gate` is cleared (tests hold the backend busy with it).

Samplers generate, for sample ``j`` of a prompt ending in token ``p``, the tokens
``p + 3 j + 1, p + 3 j + 2, ...`` (mod 1000) up to ``max_tokens`` (8 when unset), stopping early at
a token listed in ``stop`` (``stop_reason`` "stop", else "length"); their log-probabilities, and
the prompt's, follow ``fake_logprobs`` with the sampler's ``w`` (an inflight sampler's ``w`` is its
training client's at its newest inflight save); top-k, target and alternative logprobs follow the
same formula (`FakeSamplingClient._sample`).

Bad input raises `UserError`: an unknown model, checkpoint path or loss, a loss input that is
missing or has the wrong dtype or rank, a LoRA rank below 1, a negative temperature.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from meshrl.api.errors import UserError
from meshrl.api.losses import CUSTOM, custom_call, custom_loss
from meshrl.api.types import (ForwardBackwardOutput, PromptAltTokens, SampledSequence, SampleResponse,
                              SamplingParams, SupportedModel)
from meshrl.losses.fx_graph import reduce_metrics, sum_over_datums
from meshrl.training.optimizers import ADAMW, DIMUON, OPTIMIZERS
from meshrl.types import AdamParams, Datum, DimuonParams, ModelInput

# the loss_fn_inputs each loss reads, besides target_tokens
LOSS_INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
               "ppo": ("logprobs", "advantages"), "dro": ("logprobs", "advantages"),
               "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
               "stable_reinforce": ("logprobs", "advantages", "mask")}
DEFAULT_MAX_TOKENS = 8
GATE_TIMEOUT_S = 60.0
"""Longest a training call waits for a closed `FakeService.gate`."""


def fake_logprobs(tokens: list[int] | torch.Tensor, w: float) -> torch.Tensor:
    """The fake model's float32 log-probabilities of ``tokens`` (one per position) at weight ``w``."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    positions = torch.arange(tokens.shape[0])
    return -(1 + (7 * tokens + positions) % 13).to(torch.float32) / 8 - torch.tensor(w, dtype=torch.float32)


@dataclass
class _Checkpoint:
    w: float
    step: int
    momentum: float
    rank: int
    optimizer: str


class FakeTrainingClient:
    """A LoRA training client whose model is the single weight ``w``."""

    def __init__(self, service: FakeService, model_id: str, base_model: str, rank: int, optimizer: str = "adamw"):
        self.model_id = model_id
        self.base_model = base_model
        self.lora_rank = rank
        self.optimizer = optimizer
        self._service = service
        self._w = 0.0
        self._grad = 0.0
        self._step = 0
        self._momentum = 0.0
        self.inflight: tuple[float, str] | None = None  # (w, path) of the newest inflight save
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fake-{model_id}")

    def _run(self, operation: str, call: Callable[[], Any], data: list[Datum] | None = None) -> Future:
        def logged() -> Any:
            tags = tuple(d.model_input.to_ints()[0] for d in data) if data else ()
            self._service.record(self.model_id, operation, tags)
            if not self._service.gate.wait(GATE_TIMEOUT_S):
                raise TimeoutError(f"{operation}: FakeService.gate stayed closed for {GATE_TIMEOUT_S:g} s")
            time.sleep(self._service.delay_s)
            return call()
        return self._worker.submit(logged)

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None) -> Future:
        return self._run("forward_backward", lambda: self._loss(data, loss_fn, loss_fn_config, True), data)

    def forward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None) -> Future:
        return self._run("forward", lambda: self._loss(data, loss_fn, loss_fn_config, False), data)

    def _loss(self, data: list[Datum], loss_fn: str, config: dict | None, backward: bool) -> ForwardBackwardOutput:
        if loss_fn == CUSTOM:
            return self._custom_loss(data, config, backward)
        if loss_fn not in LOSS_INPUTS:
            raise UserError(f"unknown loss_fn {loss_fn!r}; the fake serves {sorted(LOSS_INPUTS)}")
        outputs, total, grad = [], 0.0, 0.0
        for i, datum in enumerate(data):
            inputs = datum.loss_fn_inputs
            for key in ("target_tokens", *LOSS_INPUTS[loss_fn]):
                if key not in inputs:
                    raise UserError(f"data[{i}]: loss_fn_inputs lacks {key!r}, which {loss_fn} needs")
            targets = inputs["target_tokens"]
            if targets.dtype != torch.int64 or targets.dim() != 1:
                raise UserError(f"data[{i}]: target_tokens must be 1-D int64, got {targets.dtype} "
                                f"{list(targets.shape)}")
            logprobs = fake_logprobs(targets, self._w)
            if loss_fn == "cross_entropy":
                total += float(-(logprobs * inputs["weights"]).sum())
                grad += float(inputs["weights"].sum())
            else:
                ratio = torch.exp(logprobs - inputs["logprobs"])
                if loss_fn == "ppo":
                    cfg = config or {}
                    ratio = ratio.clamp(cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
                total += float(-(ratio * inputs["advantages"]).sum())
                grad += float(inputs["advantages"].sum())
            outputs.append({"logprobs": logprobs})
        if backward:
            self._grad += grad
        return ForwardBackwardOutput(outputs, {"loss:sum": total})

    def _custom_loss(self, data: list[Datum], config: dict | None, backward: bool) -> ForwardBackwardOutput:
        datums, _ = custom_call(config, data)
        loss = custom_loss(config)
        w = torch.tensor(self._w, dtype=torch.float32, requires_grad=True)
        logprobs = [fake_logprobs(d.loss_fn_inputs["target_tokens"], 0.0) - w for d in datums]
        total, sums = sum_over_datums(loss, logprobs, [[d.loss_fn_inputs[k] for k in loss.input_names] for d in datums])
        if backward:
            self._grad += float(torch.autograd.grad(total, w)[0])
        return ForwardBackwardOutput([{"logprobs": lp.detach()} for lp in logprobs],
                                     {"loss:sum": float(total.detach()), **reduce_metrics(sums, len(datums))})

    def optim_step(self, params: AdamParams | DimuonParams) -> Future:
        def step() -> dict[str, float]:
            if (DIMUON if isinstance(params, DimuonParams) else ADAMW) != self.optimizer:
                raise UserError(f"optim_step: {self.model_id} trains with {self.optimizer!r}, not with "
                                f"{type(params).__name__}")
            grad, self._grad = self._grad, 0.0
            self._momentum = params.beta1 * self._momentum + (1 - params.beta1) * grad
            sign = math.copysign(1.0, self._momentum) if self._momentum else 0.0
            direction = grad if self.optimizer == ADAMW else sign
            self._w -= params.learning_rate * direction
            self._step += 1
            return {"grad:sum": grad, "step:max": float(self._step)}
        return self._run("optim_step", step)

    def save_state(self, name: str) -> Future:
        def save() -> str:
            path = f"tinker://{self.model_id}/weights/{name}"
            self._service.checkpoints[path] = _Checkpoint(self._w, self._step, self._momentum, self.lora_rank,
                                                          self.optimizer)
            return path
        return self._run("save_state", save)

    def load_state(self, path: str) -> Future:
        return self._run("load_state", lambda: self._load(path, with_optimizer=False))

    def load_state_with_optimizer(self, path: str) -> Future:
        return self._run("load_state_with_optimizer", lambda: self._load(path, with_optimizer=True))

    def _load(self, path: str, with_optimizer: bool) -> None:
        checkpoint = self._service.checkpoints.get(path)
        if checkpoint is None:
            raise UserError(f"unknown checkpoint path {path!r}")
        if checkpoint.rank != self.lora_rank:
            raise UserError(f"checkpoint {path!r} has LoRA rank {checkpoint.rank}, this model {self.lora_rank}")
        self._w, self._grad = checkpoint.w, 0.0
        self._step, self._momentum = (checkpoint.step, checkpoint.momentum) if with_optimizer else (0, 0.0)
        if with_optimizer:
            self.optimizer = checkpoint.optimizer

    def save_weights_for_sampler(self, name: str, kind: str = "snapshot") -> Future:
        def save() -> str:
            path = f"tinker://{self.model_id}/sampler_weights/{name}"
            self._service.sampler_weights[path] = self._w
            if kind == "inflight":
                self.inflight = (self._w, path)
            return path
        return self._run("save_weights_for_sampler", save)

    def inflight_sampling_client(self) -> FakeSamplingClient:
        """A sampler at this client's newest inflight save's ``w``, whenever it samples."""
        if self.inflight is None:
            raise UserError(f"{self.model_id}: no inflight save yet")
        return FakeSamplingClient(self._service, self.inflight[1], self.base_model, self.inflight[0], follows=self)

    def close(self) -> None:
        self._service.record(self.model_id, "close", ())
        self._worker.shutdown(wait=False)


class FakeSamplingClient:
    """A sampler of the fake model at a fixed weight, or at the weight of the newest inflight save
    of the training client it ``follows``."""

    def __init__(self, service: FakeService, model_path: str | None, base_model: str, w: float,
                 follows: FakeTrainingClient | None = None):
        self.model_path = model_path
        self.base_model = base_model
        self._service = service
        self._w = w
        self._follows = follows

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs=None, prompt_alt_tokens_k: int = 0, owner: str | None = None) -> Future:
        w = self._w if self._follows is None else self._follows.inflight[0]
        return self._service.pool.submit(self._sample, prompt.to_ints(), num_samples, sampling_params, w,
                                         include_prompt_logprobs, topk_prompt_logprobs, topk_sample_logprobs,
                                         target_prompt_logprobs, prompt_alt_tokens_k)

    def _sample(self, prompt: list[int], num_samples: int, params: SamplingParams, w: float,
                include_prompt_logprobs: bool, topk_prompt: int, topk_sample: int, targets, alt_k: int) -> SampleResponse:
        """The fake's top-k at a token t of logprob l: (t + j) mod 1000 with l - j, j < k; the
        logprob of id t at prompt row i (position i + 1) is ``fake_logprobs([t])`` at position i,
        as the prompt's own; the draws at row i are prompt[i + 1] + 1 + j (mod 1000)."""
        if params.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {params.temperature}")
        stop_ids = {s for s in params.stop or () if isinstance(s, int)}
        sequences = []
        for j in range(num_samples):
            tokens, reason = [], "length"
            for k in range(params.max_tokens or DEFAULT_MAX_TOKENS):
                tokens.append((prompt[-1] + 3 * j + k + 1) % 1000)
                if tokens[-1] in stop_ids:
                    reason = "stop"
                    break
            logprobs = fake_logprobs(tokens, w).tolist()
            sequences.append(SampledSequence(reason, tokens, logprobs,
                                             _fake_topk(tokens, logprobs, topk_sample) if topk_sample else None))
        response = SampleResponse(sequences)
        own = fake_logprobs(prompt[1:], w).tolist()
        if include_prompt_logprobs:
            response.prompt_logprobs = [None, *own]
        if topk_prompt:
            response.topk_prompt_logprobs = [None, *_fake_topk(prompt[1:], own, topk_prompt)]
        if targets is not None:
            ids = torch.as_tensor(targets, dtype=torch.int64)
            rows = torch.arange(ids.shape[0])[:, None]
            scored = -(1 + (7 * ids + rows) % 13).to(torch.float32) / 8 - w
            response.target_prompt_logprobs = torch.where(ids >= 0, scored, torch.zeros(()))
        if alt_k:
            drawn = (torch.tensor(prompt[1:])[:, None] + 1 + torch.arange(alt_k)) % 1000
            rows = torch.arange(drawn.shape[0])[:, None]
            response.prompt_alt_tokens = PromptAltTokens(drawn, -(1 + (7 * drawn + rows) % 13).to(torch.float32) / 8 - w)
        return response


def _fake_topk(tokens: list[int], logprobs: list[float], k: int) -> list[list[tuple[int, float]]]:
    return [[((t + j) % 1000, lp - j) for j in range(k)] for t, lp in zip(tokens, logprobs)]


class FakeService:
    """The fake backend: one served model, its training clients, checkpoints and samplers."""

    def __init__(self, model_name: str = "fake-model", max_context_length: int = 4096):
        self.model_name = model_name
        self.max_context_length = max_context_length
        self.checkpoints: dict[str, _Checkpoint] = {}
        self.sampler_weights: dict[str, float] = {}
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []
        self.delay_s = 0.0  # how long each training call takes (tests of slow operations set it)
        self.gate = threading.Event()  # training calls wait while it is cleared
        self.gate.set()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fake-sampler")
        self._lock = threading.Lock()

    def record(self, model_id: str, operation: str, tags: tuple[int, ...]) -> None:
        with self._lock:
            self.calls.append((model_id, operation, tags))

    def calls_of(self, model_id: str) -> list[tuple[str, tuple[int, ...]]]:
        """(operation, first tokens) of every executed call of one model, in execution order."""
        with self._lock:
            return [(op, tags) for m, op, tags in self.calls if m == model_id]

    def get_server_capabilities(self) -> list[SupportedModel]:
        return [SupportedModel(self.model_name, self.max_context_length)]

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def tokenizer_id(self) -> str | None:
        return None

    def _check_model(self, base_model: str) -> None:
        if base_model != self.model_name:
            raise UserError(f"unknown model {base_model!r}; the fake serves {self.model_name!r}")

    def create_lora_training_client(self, base_model: str, rank: int, seed: int | None, train_mlp: bool,
                                    train_attn: bool, train_unembed: bool, model_id: str,
                                    optimizer: str = ADAMW) -> FakeTrainingClient:
        self._check_model(base_model)
        if rank < 1:
            raise UserError(f"LoRA rank must be >= 1, got {rank}")
        if optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {optimizer!r}; the fake serves {OPTIMIZERS}")
        return FakeTrainingClient(self, model_id, base_model, rank, optimizer)

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> FakeSamplingClient:
        if model_path is not None:
            if model_path not in self.sampler_weights:
                raise UserError(f"unknown sampler checkpoint {model_path!r}")
            return FakeSamplingClient(self, model_path, self.model_name, self.sampler_weights[model_path])
        self._check_model(base_model or "")
        return FakeSamplingClient(self, None, self.model_name, 0.0)

    def delete_checkpoint(self, path: str) -> None:
        if self.checkpoints.pop(path, None) is None and self.sampler_weights.pop(path, None) is None:
            raise UserError(f"unknown checkpoint path {path!r}")


def fake_service(cfg: Any) -> FakeService:
    """`serve.backend` factory: the fake serving `model.name_or_path` with `model.max_model_len`."""
    return FakeService(cfg.model.name_or_path, cfg.model.max_model_len)
