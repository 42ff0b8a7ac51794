"""Training models: the backend's training clients behind the SDK's model ids.

A model is created by `create_model` (a LoRA adapter on a served model) or by `load_weights` with
a session and model number (a training client made from a checkpoint). Its id is
`{session_id}:train:{model_seq_id}`, the form the SDK derives itself. Each model's requests go
through a `SeqOrder` (`seq_id` order), then wait their tenant's turn (`Turns`: one training call
at a time, the tenants in rotation, so no tenant's backlog delays another's call by more than one
call), and then a single-thread worker makes the backend call, so the backend receives them in
order and the event loop never blocks on a backend call. A request retried with a `seq_id`
already seen gets the first attempt's request id.

Checkpoints saved through the server are remembered with the LoRA settings of the model that
saved them: a training client can be created from one of those (a checkpoint from elsewhere does
not say which adapter shape to create). The records of models (`TrainingRun`) and checkpoints
(`SavedCheckpoint`) outlive their sessions, for the SDK's `RestClient` listings.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from meshrl.api.errors import UserError
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.futures import FailedResult, FutureStore, JsonResult, Outcome, failure, run_on
from meshrl.serve.ordering import SeqOrder
from meshrl.serve.turns import Turns
from meshrl.training.optimizers import ADAMW

# request ids kept per model for retried requests (a retry comes right after its first attempt)
_REMEMBERED_SEQ_IDS = 1024


@dataclass(frozen=True)
class LoraSpec:
    """What a training model is: the model name the client asked for and its adapter."""

    base_model: str
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    optimizer: str = ADAMW
    """``adamw`` or ``dimuon`` (the SDK's `OptimizerConfig` type), fixed at creation."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class TrainingRun:
    """What the SDK calls a training run: one model this server created, open or closed."""

    model_id: str
    session_id: str
    spec: LoraSpec
    user_metadata: dict[str, str] | None = None
    last_request: datetime = field(default_factory=_now)


@dataclass
class SavedCheckpoint:
    """A checkpoint saved through this server: its `tinker://` path, the model that saved it (and
    so its adapter's shape), when, and when it expires (None: never)."""

    path: str
    model_id: str
    spec: LoraSpec
    user_metadata: dict[str, str] | None = None
    time: datetime = field(default_factory=_now)
    expires_at: datetime | None = None

    @property
    def checkpoint_id(self) -> str:
        """``weights/<name>`` or ``sampler_weights/<name>``: the path after the model id."""
        return self.path.split("/", 3)[3]

    def expire_after(self, ttl_seconds: int | None) -> None:
        self.expires_at = None if ttl_seconds is None else _now() + timedelta(seconds=ttl_seconds)

    def sdk(self) -> dict:
        """As the SDK's `Checkpoint`."""
        kind = "training" if self.checkpoint_id.startswith("weights/") else "sampler"
        return {"checkpoint_id": self.checkpoint_id, "checkpoint_type": kind, "time": self.time.isoformat(),
                "tinker_path": self.path, "user_metadata": self.user_metadata,
                "expires_at": None if self.expires_at is None else self.expires_at.isoformat()}


class TrainingModel:
    """One backend training client, its ordered request queue and the worker that calls it."""

    def __init__(self, model_id: str, session_id: str, spec: LoraSpec, gap_timeout_s: float, owner: str | None):
        self.model_id = model_id
        self.session_id = session_id
        self.spec = spec
        self.owner = owner
        """The tenant whose turns the model's calls take (None: the one tenant of an open server)."""
        self.client: Any = None  # the backend TrainingClient, once created
        self.order = SeqOrder(model_id, gap_timeout_s)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"serve-{model_id}")
        self.requests: dict[int, str] = {}  # seq_id -> request id

    def created_client(self) -> Any:
        """The backend client, or UserError if its creation failed (called on the worker, after
        the creation)."""
        if self.client is None:
            raise UserError(f"{self.model_id} could not be created (see its create_model result)")
        return self.client

    def close_client(self) -> None:
        """Close the backend client, if it was created (called on the worker)."""
        if self.client is not None:
            self.client.close()


Operation = Callable[[Any], Future]
"""A backend call on a training client, returning its future."""


class TrainingModels:
    """Every training model of the server, by model id."""

    def __init__(self, service: Any, catalogue: ModelCatalogue, futures: FutureStore, gap_timeout_s: float,
                 tokenizer: str | None, turns: Turns):
        self._service = service
        self._turns = turns
        self._tokenizer = tokenizer
        self._catalogue = catalogue
        self._futures = futures
        self._gap_timeout_s = gap_timeout_s
        self._models: dict[str, TrainingModel] = {}
        self._creations: dict[str, str] = {}  # model id -> request id of its creation
        self.runs: dict[str, TrainingRun] = {}  # model id -> its record, open or closed
        self.checkpoints: dict[str, SavedCheckpoint] = {}  # tinker:// path -> its record

    def create(self, session_id: str, model_seq_id: int, spec: LoraSpec,
               user_metadata: dict[str, str] | None = None, owner: str | None = None) -> tuple[str, str]:
        """Start creating a LoRA training model of tenant ``owner``; (request id, model id)."""
        return self._create(session_id, model_seq_id, spec, None,
                            lambda model_id: JsonResult({"model_id": model_id, "type": "create_model"}),
                            user_metadata, owner)

    def create_from_checkpoint(self, session_id: str, model_seq_id: int, path: str, with_optimizer: bool,
                               base_model: str | None, user_metadata: dict[str, str] | None = None,
                               optimizer: str | None = None, owner: str | None = None) -> str:
        """Start creating a training model loaded from a checkpoint this server saved; request id.
        With the optimizer it is the checkpoint's; without, ``optimizer`` (default AdamW) starts fresh."""
        saved = self.checkpoints.get(path)
        if saved is None:
            request_id = self._futures.create()
            self._futures.settle(request_id, FailedResult(
                f"unknown checkpoint {path!r}: a training client can only be created from a checkpoint "
                "this server saved (it records the LoRA shape)", "user"))
            return request_id
        spec = saved.spec if base_model is None else replace(saved.spec, base_model=base_model)
        if not with_optimizer:
            spec = replace(spec, optimizer=optimizer or ADAMW)

        def load(client: Any) -> Future:
            return client.load_state_with_optimizer(path) if with_optimizer else client.load_state(path)

        request_id, _ = self._create(session_id, model_seq_id, spec, load, lambda model_id: JsonResult(
            {"path": path, "model_id": model_id, "type": "load_weights"}), user_metadata, owner)
        return request_id

    def _create(self, session_id: str, model_seq_id: int, spec: LoraSpec, first: Operation | None,
                encode: Callable[[str], Outcome], user_metadata: dict[str, str] | None,
                owner: str | None) -> tuple[str, str]:
        """Create a model's backend client on its worker in ``owner``'s turn, then run ``first`` on
        it (if given); the request id answers ``encode(model_id)`` once both are done."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self._creations:  # a retried request
            return self._creations[model_id], model_id
        request_id = self._creations[model_id] = self._futures.create()
        try:
            served = self._catalogue.resolve(spec.base_model)
        except UserError as exc:
            self._futures.settle(request_id, failure(exc))
            return request_id, model_id
        model = self._models[model_id] = TrainingModel(model_id, session_id, spec, self._gap_timeout_s, owner)
        self.runs[model_id] = TrainingRun(model_id, session_id, spec, user_metadata)

        def create() -> Future:
            model.client = self._service.create_lora_training_client(
                base_model=served, rank=spec.rank, seed=spec.seed, train_mlp=spec.train_mlp,
                train_attn=spec.train_attn, train_unembed=spec.train_unembed, model_id=model_id,
                optimizer=spec.optimizer)
            if first is not None:
                return first(model.client)
            created: Future = Future()
            created.set_result(None)
            return created

        def start() -> Future | None:
            try:
                future = run_on(model.worker, create)
            except RuntimeError:  # the session finished before the creation's turn came
                self._futures.settle(request_id, FailedResult(f"{model_id} was closed before it was created", "user"))
                return None
            self._futures.track(request_id, future, lambda _: encode(model_id))
            return future

        self._turns.add(owner, start)
        return request_id, model_id

    def model(self, model_id: str) -> TrainingModel:
        model = self._models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return model

    def info(self, model_id: str) -> dict:
        """The `get_info` reply: the model name the client asked for and its adapter."""
        model = self.model(model_id)
        model_data = {"model_name": model.spec.base_model}
        if self._tokenizer is not None:
            model_data["tokenizer_id"] = self._tokenizer
        return {"type": "get_info", "model_id": model_id, "model_data": model_data, "is_lora": True,
                "lora_rank": model.spec.rank, "model_name": model.spec.base_model}

    def submit(self, model_id: str, seq_id: int | None, operation: Operation,
               encode: Callable[[Any], Outcome], release: Callable[[], None] | None = None) -> str:
        """Queue a backend call on a model in `seq_id` order; the request id answers with
        ``encode(result)``. A request for an unknown model fails with a user error. ``release``
        is called once the request is done with (its backend call finished, or it never started)."""
        release = release or (lambda: None)
        model = self._models.get(model_id)
        if model is not None and seq_id in model.requests:  # a retried request
            release()
            return model.requests[seq_id]
        request_id = self._futures.create()
        if model is None or seq_id is None:
            release()
            reason = f"unknown model_id {model_id!r}" if model is None else f"{model_id}: seq_id is missing"
            self._futures.settle(request_id, FailedResult(reason, "user"))
            return request_id
        model.requests[seq_id] = request_id
        self.runs[model_id].last_request = _now()
        if len(model.requests) > _REMEMBERED_SEQ_IDS:  # only a recent request can be retried
            del model.requests[next(iter(model.requests))]

        def start() -> Future | None:
            try:
                future = run_on(model.worker, lambda: operation(model.created_client()))
            except RuntimeError:  # the model was closed meanwhile: its worker takes nothing more
                fail(f"{model_id} was closed before seq_id {seq_id} ran", "user")
                return None
            future.add_done_callback(lambda _: release())
            self._futures.track(request_id, future, encode)
            return future

        def fail(reason: str, category: str = "server") -> None:
            release()
            self._futures.settle(request_id, FailedResult(reason, category))

        model.order.arrive(seq_id, lambda: self._turns.add(model.owner, start), fail)
        return request_id

    def remember_checkpoint(self, model_id: str, path: str, ttl_seconds: int | None = None,
                            user_metadata: dict[str, str] | None = None) -> None:
        """Record that ``path`` holds a checkpoint of ``model_id``'s adapter (if the model is
        still open), expiring after ``ttl_seconds`` (None: never)."""
        model = self._models.get(model_id)
        if model is not None:
            saved = self.checkpoints[path] = SavedCheckpoint(path, model_id, model.spec, user_metadata)
            saved.expire_after(ttl_seconds)

    def checkpoint_base_model(self, path: str) -> str | None:
        """The model name of the model that saved ``path``, if this server saved it."""
        saved = self.checkpoints.get(path)
        return None if saved is None else saved.spec.base_model

    def close_session(self, session_id: str) -> None:
        """Close the backend clients of a session's models (after their queued calls)."""
        for model_id in [m for m, model in self._models.items() if model.session_id == session_id]:
            model = self._models.pop(model_id)
            model.worker.submit(model.close_client)  # on the worker: after its creation and queued calls
            model.worker.shutdown(wait=False)

    def forget_session(self, session_id: str) -> None:
        """Drop the run records of a finished session that saved no checkpoint still kept."""
        for model_id in [m for m, run in self.runs.items() if run.session_id == session_id]:
            del self.runs[model_id]
            self._creations.pop(model_id, None)

    def saved_by(self, session_id: str) -> bool:
        """Whether a checkpoint still kept was saved by a model of ``session_id``."""
        return any(self.runs[saved.model_id].session_id == session_id for saved in self.checkpoints.values()
                   if saved.model_id in self.runs)

    def close_all(self) -> None:
        for session_id in {model.session_id for model in self._models.values()}:
            self.close_session(session_id)
