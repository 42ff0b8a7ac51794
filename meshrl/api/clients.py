"""`ServiceClient`, `TrainingClient`, `SamplingClient`: Tinker's client API, in process, over
meshrl's meshes (`MeshBackend`). Every call returns a future at once (`concurrent.futures.Future`:
`.result()` waits); a training client runs its calls one after the other in the order they were
made, so two submissions back to back need no wait in between."""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from meshrl.api.backend import MeshBackend, checkpoint_root
from meshrl.api.errors import UserError
from meshrl.api.losses import CUSTOM, core_call, custom_metric_sums, metrics_with_reductions
from meshrl.api.sampler import PromptOptions, Sampler
from meshrl.api.types import ForwardBackwardOutput, SampleResponse, SamplingParams, SupportedModel
from meshrl.config.run import RunConfig
from meshrl.training.lora import unembedding_is_tied
from meshrl.training.optimizers import ADAMW, DIMUON, OPTIMIZERS
from meshrl.types import AdamParams, Datum, DimuonParams, ModelInput

log = logging.getLogger("meshrl")

SAMPLING_CLIENT_KINDS = ("snapshot", "inflight")
"""Tinker's `SamplingClientKind`: fixed weights, or a training client's newest inflight save."""

CHECKPOINT_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
"""What a checkpoint may be named: letters, digits, ``_ . -``, not starting with a dot (no ``.``
or ``..``), at most 128 characters."""
PATH = re.compile(rf"^tinker://(?P<run>[^/.][^/]*)/(?P<kind>weights|sampler_weights)/(?P<name>{CHECKPOINT_NAME})$")


class ServiceClient:
    """Entry point: ``ServiceClient(cfg)`` starts the learner and generator meshes of ``cfg`` (the
    default run config when None) on this machine, or on ``hosts`` from a launcher; `close()` (or
    leaving a `with` block) stops them."""

    def __init__(self, cfg: RunConfig | None = None, hosts=None):
        self.cfg = cfg or RunConfig()
        self.backend = MeshBackend(self.cfg, hosts)
        self.served = self.cfg.model.name_or_path
        self.root = checkpoint_root(self.cfg)
        limits = self.cfg.serve.limits
        self.sampler = Sampler(self.backend, limits.max_running_samples, limits.sample_chunk_tokens,
                               limits.version_hold_s, limits.version_turn_s)
        self._ids = itertools.count()
        self._session = f"local{id(self):x}"
        self._sampler_versions: dict[str, int] = {}  # sampler path -> weight version
        self._lock = threading.Lock()
        self._clients: list[TrainingClient] = []
        self.skipped: Counter[str] = Counter()  # requested options served without them, logged
        self.ties_unembedding = unembedding_is_tied(self.backend.model_path)
        """Whether the served model's unembedding is its input embedding (`train_unembed` then
        cannot apply)."""

    def get_server_capabilities(self) -> list[SupportedModel]:
        """The model this service trains and samples (`model.name_or_path`; `meshrl serve` adds
        the names of `serve.model_aliases`)."""
        return [SupportedModel(self.served, self.cfg.model.max_model_len)]

    def tokenizer_id(self) -> str:
        """Where the served model's tokenizer loads from (its local directory)."""
        return str(self.backend.model_path)

    def resolve_model(self, name: str) -> str:
        """``name`` if it is the served model; UserError for any other name."""
        if name == self.served:
            return name
        raise UserError(f"base_model {name!r} is not served here (serving {self.served!r})")

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    model_id: str | None = None, optimizer: str = ADAMW) -> "TrainingClient":
        """A new LoRA adapter of ``rank`` on the base model (attention and/or MLP projections and,
        with ``train_unembed``, the unembedding), with its own optimizer state. A model that ties
        its unembedding to its input embedding cannot have one adapted apart from the other:
        there ``train_unembed`` (Tinker's default) is accepted and not applied, logged and counted
        (`skipped["train_unembed"]`), and the adapter trains the other modules. ``optimizer``
        (``adamw`` or ``dimuon``) is fixed for the client's life (Tinker's `OptimizerConfig`)."""
        self.resolve_model(base_model)
        if not isinstance(rank, int) or rank < 1:
            raise UserError(f"rank = {rank!r}: a LoRA rank >= 1")
        if optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {optimizer!r} is not served: use one of {', '.join(OPTIMIZERS)}")
        unembed = train_unembed and not self.ties_unembedding
        if not (train_mlp or train_attn or unembed):
            raise UserError("train_mlp and train_attn are false" + (
                f" and train_unembed cannot apply ({self.served} ties its unembedding to its embedding)"
                if train_unembed else " and so is train_unembed") + ": nothing to train")
        if train_unembed and not unembed:
            self.skipped["train_unembed"] += 1
            log.warning("train_unembed=True: %s ties its unembedding to its embedding, so the adapter trains %s only",
                        self.served, " and ".join(n for n, on in (("attention", train_attn), ("MLP", train_mlp)) if on))
        model_id = model_id or f"{self._session}:train:{next(self._ids)}"
        client = TrainingClient(self, model_id, base_model, rank, optimizer)
        self.backend.learner(None, "add_adapter", client.adapter, rank, None, seed, train_mlp, train_attn, unembed,
                             optimizer)
        self._clients.append(client)
        return client

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> "SamplingClient":
        """Samples from a saved sampler checkpoint (``model_path``) or from the base model."""
        if (model_path is None) == (base_model is None):
            raise UserError("create_sampling_client needs exactly one of model_path and base_model")
        if model_path is not None:
            with self._lock:
                version = self._sampler_versions.get(model_path)
            if version is None:
                raise UserError(f"model_path {model_path!r}: no sampler weights saved under that path")
            return SamplingClient(self, version, model_path=model_path)
        self.resolve_model(base_model)
        return SamplingClient(self, 0, base_model=base_model)

    def checkpoint_dir(self, path: str) -> Path:
        """The directory behind a ``tinker://run/kind/name`` path; UserError when it is malformed."""
        match = PATH.match(path)
        if not match:
            raise UserError(f"path {path!r}: expected tinker://<run>/weights/<name> or .../sampler_weights/<name> "
                            "(a name of letters, digits and _ . -, not starting with a dot, at most 128 characters)")
        return self.root / _safe(match["run"]) / match["kind"] / match["name"]

    def delete_checkpoint(self, path: str) -> None:
        """Delete the checkpoint at ``path`` (sampling clients made from it keep their weights);
        UserError when there is none."""
        directory = self.checkpoint_dir(path)
        if not directory.is_dir():
            raise UserError(f"path {path!r}: no checkpoint there")
        shutil.rmtree(directory)
        with self._lock:
            self._sampler_versions.pop(path, None)

    def register_sampler(self, path: str, version: int) -> None:
        with self._lock:
            self._sampler_versions[path] = version

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.sampler.close()
        self.backend.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrainingClient:
    """One LoRA adapter being trained; calls run in submission order on its own queue."""

    def __init__(self, service: ServiceClient, model_id: str, base_model: str, rank: int, optimizer: str):
        self.service = service
        self.backend = service.backend
        self.model_id = model_id
        self.base_model = base_model
        self.lora_rank = rank
        self.optimizer = optimizer
        """``adamw`` or ``dimuon``: chosen at creation (a load with the optimizer takes the checkpoint's)."""
        self.adapter = "t_" + _safe(model_id)
        self._queue = ThreadPoolExecutor(1, thread_name_prefix=f"train-{self.adapter}")
        self._closed = False
        self.inflight_version: int | None = None  # the newest inflight save's weight version
        self.inflight_path: str | None = None

    def _submit(self, fn: Callable, *args) -> Future:
        return self._queue.submit(fn, *args)

    def _learner(self, endpoint: str, *args):
        return self.backend.learner(self.adapter, endpoint, *args)

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None) -> Future:
        """Accumulate the gradients of Tinker's built-in ``loss_fn`` (sum over tokens) on ``data``,
        or of an uploaded custom loss (``loss_fn='custom'``, ``loss_fn_config``: its graph)."""
        def run() -> ForwardBackwardOutput:
            datums, config = core_call(loss_fn, loss_fn_config, data)
            out = self._learner("forward_backward", datums, loss_fn, config, False, True)
            return ForwardBackwardOutput([{"logprobs": torch.tensor(lp)} for lp in out["logprobs"]],
                                         _tinker_metrics(loss_fn, out, len(data)))
        return self._submit(run)

    def forward(self, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None) -> Future:
        """``loss_fn`` on ``data`` without gradients: the target logprobs and the loss metrics."""
        def run() -> ForwardBackwardOutput:
            datums, config = core_call(loss_fn, loss_fn_config, data)
            out = self._learner("forward_loss", datums, loss_fn, config)  # the loss runs in the learner too
            return ForwardBackwardOutput([{"logprobs": torch.tensor(lp)} for lp in out["logprobs"]],
                                         _tinker_metrics(loss_fn, out, len(data)))
        return self._submit(run)

    def forward_backward_custom(self, data: list[Datum], fn) -> Future:
        """Accumulate the gradients of ``fn(data, logprobs) -> (loss, metrics)`` (a picklable,
        module-level function; ``logprobs[i]`` are datum i's target logprobs, differentiable)."""
        def run() -> ForwardBackwardOutput:
            if not data:
                raise UserError("data: no datums")
            out = self._learner("forward_backward_custom", list(data), fn)
            return ForwardBackwardOutput([{} for _ in data], metrics_with_reductions(out))
        return self._submit(run)

    def optim_step(self, params: AdamParams | DimuonParams) -> Future:
        """One step of this adapter's optimizer with the gradients accumulated so far (AdamW takes
        `AdamParams`, Dimuon `DimuonParams`); then clears them."""
        def run() -> dict:
            if (DIMUON if isinstance(params, DimuonParams) else ADAMW) != self.optimizer:
                wanted = "DimuonParams" if self.optimizer == DIMUON else "AdamParams"
                raise UserError(f"optim_step: {self.model_id} trains with {self.optimizer!r} (chosen when it was "
                                f"created): pass {wanted}, not {type(params).__name__}")
            return self._learner("optim_step", params)
        return self._submit(run)

    def save_state(self, name: str) -> Future:
        """Adapter and optimizer state under ``name``; the future gives its ``tinker://`` path."""
        return self._submit(self._save, "weights", name)

    def _save(self, kind: str, name: str) -> str:
        path = f"tinker://{self.model_id}/{kind}/{name}"
        self._learner("save_adapter", self.adapter, str(self.service.checkpoint_dir(path)))
        return path

    def load_state(self, path: str) -> Future:
        """Load the adapter weights saved at ``path`` (optimizer state starts fresh)."""
        return self._submit(self._load, path, False)

    def load_state_with_optimizer(self, path: str) -> Future:
        """Load the adapter weights and the optimizer state saved at ``path``."""
        return self._submit(self._load, path, True)

    def _load(self, path: str, with_optimizer: bool) -> str:
        directory = self.service.checkpoint_dir(path)
        if not directory.is_dir():
            raise UserError(f"path {path!r}: no checkpoint there")
        self.optimizer = self._learner("load_adapter", self.adapter, str(directory), with_optimizer)["optimizer_type"]
        return path

    def save_weights_for_sampler(self, name: str, kind: str = "snapshot") -> Future:
        """Publish the adapter's current weights for sampling; the future gives their path.
        ``kind='inflight'`` also makes them what this client's inflight sampling clients sample
        from now on (Tinker's `SamplingClientKind`)."""
        if kind not in SAMPLING_CLIENT_KINDS:
            raise UserError(f"kind = {kind!r}: one of {', '.join(SAMPLING_CLIENT_KINDS)}")

        def run() -> str:
            path = self._save("sampler_weights", name)
            version = self.backend.publish(self.adapter, self.service.checkpoint_dir(path))
            self.service.register_sampler(path, version)
            if kind == "inflight":
                self.inflight_version, self.inflight_path = version, path
            return path
        return self._submit(run)

    def save_weights_and_get_sampling_client(self, name: str, kind: str = "snapshot") -> "SamplingClient":
        """`save_weights_for_sampler` and a sampling client on the result (waits for it): a
        snapshot of these weights, or (``kind='inflight'``) a client that samples this training
        client's newest inflight save, these weights or newer."""
        path = self.save_weights_for_sampler(name, kind).result()
        return self.inflight_sampling_client() if kind == "inflight" else \
            self.service.create_sampling_client(model_path=path)

    def inflight_sampling_client(self) -> "SamplingClient":
        """A sampling client that samples this training client's newest inflight save at each
        request (Tinker's `kind='inflight'`: later inflight saves move every such client on)."""
        if self.inflight_version is None:
            raise UserError(f"{self.model_id}: no inflight save yet (save_weights_for_sampler(kind='inflight'))")
        return SamplingClient(self.service, self.inflight_version, model_path=self.inflight_path, follows=self)

    def get_info(self) -> dict:
        return {"model_id": self.model_id, "model_data": {"model_name": self.base_model},
                "is_lora": True, "lora_rank": self.lora_rank}

    def get_tokenizer(self):
        return self.backend.tokenizer

    def close(self) -> None:
        """Finish the queued calls, then free the adapter in the learner (once)."""
        self._queue.shutdown(wait=True)
        if not self._closed:
            self._closed = True
            self.backend.forget_adapter(self.adapter)


class SamplingClient:
    """Samples from one weight version: a saved sampler checkpoint's, or the base model's (0); or,
    following a training client's inflight saves (``follows``), the newest one at each request."""

    def __init__(self, service: ServiceClient, version: int, model_path: str | None = None,
                 base_model: str | None = None, follows: TrainingClient | None = None):
        self.service = service
        self._version = version
        self.model_path = model_path
        self.base_model = base_model or service.served
        self.follows = follows

    @property
    def version(self) -> int:
        """The weight version the next request samples."""
        return self.follows.inflight_version if self.follows is not None else self._version

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs=None, prompt_alt_tokens_k: int = 0, owner: str | None = None) -> Future:
        """``num_samples`` continuations of ``prompt``: tokens, their logprobs, stop reasons, and
        what was asked besides (Tinker's options: the prompt's logprobs, the top-k tokens at each
        prompt or sampled position, the logprobs of chosen ids at each prompt position
        (``target_prompt_logprobs``: [len(prompt) - 1, K] ids, -1 for none), alternative draws);
        a future of a `SampleResponse`. ``owner``: who asks (a tenant), for the sampler's turns."""
        targets = None
        if target_prompt_logprobs is not None:
            targets = tuple(tuple(int(t) for t in row) for row in torch.as_tensor(target_prompt_logprobs).tolist())
        options = PromptOptions(bool(include_prompt_logprobs), topk_prompt_logprobs, topk_sample_logprobs, targets,
                                prompt_alt_tokens_k)
        return self.service.sampler.submit(self.version, prompt.to_ints(), num_samples, sampling_params, options,
                                           owner)

    def compute_logprobs(self, prompt: ModelInput) -> Future:
        """The logprob of each prompt token given those before it (None for the first)."""
        future: Future = Future()
        inner = self.sample(prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        inner.add_done_callback(lambda f: _chain(f, future, lambda r: r.prompt_logprobs))
        return future

    def get_tokenizer(self):
        return self.service.backend.tokenizer

    def get_base_model(self) -> str:
        return self.base_model


def _chain(src: Future, dst: Future, fn) -> None:
    try:
        dst.set_result(fn(src.result()))
    except BaseException as e:  # noqa: BLE001 - handed to the caller's future
        dst.set_exception(e)


def _tinker_metrics(loss_fn: str, out: dict, datums: int) -> dict[str, float]:
    metrics = metrics_with_reductions(out)
    return custom_metric_sums(metrics, datums) if loss_fn == CUSTOM else metrics


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
