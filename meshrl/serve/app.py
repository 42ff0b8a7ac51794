"""The Tinker-protocol HTTP server: a FastAPI app that the unmodified `tinker` SDK drives.

`build_app(service, cfg)` serves a backend (`meshrl.api`'s service, or the fake in
`meshrl.testing.fake_api`) under `/api/v1`: client configuration, sessions and heartbeats,
capabilities, training models (`create_model`, `get_info`, `forward_backward`, `optim_step`,
`save_weights`, `load_weights`, `save_weights_for_sampler`), sampling sessions
(`create_sampling_session`, `samplers/{id}`, `asample`) and `retrieve_future`, through which every
submitted request is answered. Request bodies are parsed with the SDK's own request models and
protobuf module, so a field the SDK renames fails loudly here.

Errors: a request the SDK polls for fails through its future as ``{"error", "category"}``
(`user` for a bad request, `server` otherwise); a direct call answers 400 (user) or 500 (server)
with the same body; a body that does not parse answers 400 naming the field. None of these stop
the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as sdk

from meshrl.api.errors import UserError
from meshrl.config.serve import ServeConfig
from meshrl.serve import wire
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.futures import FutureStore, JsonResult, ProtoResult, failure, then
from meshrl.serve.sampling import Sampler, Samplers
from meshrl.serve.training import LoraSpec, TrainingModels
from meshrl.types import AdamParams

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)

# threads for the backend's blocking calls that are not a model's own (sampling clients, samples)
_POOL_THREADS = 8


@dataclass
class _Session:
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False


def _error(message: str, category: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


async def _body(request: Request, model: type[M]) -> M:
    """The JSON body validated as one of the SDK's request models; UserError naming the first bad
    field otherwise."""
    try:
        data = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        raise UserError(f"{request.url.path}: body is not JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise UserError(f"{request.url.path}: {where}: {first['msg']}") from None


def _future(request_id: str, **extra: Any) -> dict:
    return {"request_id": request_id, **extra}


class TinkerServer:
    """The state behind the routes: sessions, training models, samplers and pending results.
    Built when the app starts, on its event loop."""

    def __init__(self, service: Any, cfg: ServeConfig, catalogue: ModelCatalogue):
        loop = asyncio.get_running_loop()
        self.cfg = cfg
        self.catalogue = catalogue
        self.service = service
        self.futures = FutureStore(loop, cfg.result_ttl_s, cfg.request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="serve-pool")
        self.training = TrainingModels(service, catalogue, self.futures, cfg.seq_gap_timeout_s,
                                       cfg.tokenizer or service.tokenizer_id())
        self.samplers = Samplers(service, catalogue, self.futures, self.pool, cfg.request_timeout_s)
        self.sessions: dict[str, _Session] = {}
        self._reaper = loop.create_task(self._finish_silent_sessions())

    def close(self) -> None:
        self._reaper.cancel()
        self.training.close_all()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _finish_silent_sessions(self) -> None:
        """Finish the sessions whose clients stopped sending heartbeats (crashed or killed), so
        their training clients do not hold the backend forever."""
        timeout = self.cfg.session_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 30.0))
            cutoff = time.monotonic() - timeout
            for session_id, session in list(self.sessions.items()):
                if not session.finished and session.last_seen < cutoff:
                    log.warning("session %s sent no heartbeat for %g s (serve.session_timeout_s): finishing it",
                                session_id, timeout)
                    self.finish_session(session_id)

    def session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"unknown session_id {session_id!r}")
        if session.finished:
            raise UserError(f"session {session_id!r} has finished")
        return session

    # ---- training ---------------------------------------------------------------------------

    def create_model(self, req: sdk.CreateModelRequest) -> dict:
        self.session(req.session_id)
        if req.lora_config is None:
            raise UserError("create_model: lora_config is missing (only LoRA training is served)")
        if req.optimizer_config.type != "adamw":
            raise UserError(f"create_model: optimizer_config.type = {req.optimizer_config.type!r}; "
                            "only adamw is served")
        lora = req.lora_config
        spec = LoraSpec(req.base_model, lora.rank, lora.seed, lora.train_mlp, lora.train_attn, lora.train_unembed)
        request_id, model_id = self.training.create(req.session_id, req.model_seq_id, spec)
        return _future(request_id, model_id=model_id)

    def forward_backward(self, msg: Any) -> dict:
        call = "forward" if msg.forward_only else "forward_backward"

        def run(client: Any) -> Future:
            return getattr(client, call)(wire.datums(msg), msg.loss_fn, wire.loss_fn_config(msg))

        return _future(self.training.submit(msg.model_id, msg.seq_id, run,
                                            lambda out: ProtoResult(wire.forward_backward_output(out))))

    def optim_step(self, req: sdk.OptimStepRequest) -> dict:
        def run(client: Any) -> Future:
            params = req.optim_params
            if not isinstance(params, sdk.AdamParams):
                raise UserError(f"optim_step: {type(params).__name__} given; only AdamParams are served")
            try:
                adam = AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                                  eps=params.eps, weight_decay=params.weight_decay,
                                  grad_clip_norm=params.grad_clip_norm)
            except ValueError as exc:
                raise UserError(f"optim_step: adam_params: {exc}") from None
            return client.optim_step(adam)

        return _future(self.training.submit(req.model_id, req.seq_id, run, lambda metrics: JsonResult(
            {"metrics": {key: float(value) for key, value in (metrics or {}).items()}})))

    def save_weights(self, req: sdk.SaveWeightsRequest) -> dict:
        def run(client: Any) -> Future:
            if not req.path:
                raise UserError("save_weights: path (the checkpoint name) is missing")
            return client.save_state(req.path)

        return _future(self.training.submit(req.model_id, req.seq_id, run, lambda path: self._saved(
            req.model_id, path, {"path": path, "type": "save_weights"})))

    def _saved(self, model_id: str, path: str, reply: dict) -> JsonResult:
        self.training.remember_checkpoint(model_id, path)
        return JsonResult(reply)

    def load_weights(self, req: sdk.LoadWeightsRequest) -> dict:
        if req.model_id is None:  # create-via-load: a new training client from a checkpoint
            if req.session_id is None or req.model_seq_id is None:
                raise UserError("load_weights: needs model_id, or session_id with model_seq_id")
            self.session(req.session_id)
            return _future(self.training.create_from_checkpoint(req.session_id, req.model_seq_id, req.path,
                                                                req.optimizer, req.base_model))

        def run(client: Any) -> Future:
            return client.load_state_with_optimizer(req.path) if req.optimizer else client.load_state(req.path)

        return _future(self.training.submit(req.model_id, req.seq_id, run, lambda _: JsonResult(
            {"path": req.path, "model_id": req.model_id, "type": "load_weights"})))

    def save_weights_for_sampler(self, req: sdk.SaveWeightsForSamplerRequest) -> dict:
        if req.path is not None:
            return _future(self.training.submit(
                req.model_id, req.seq_id, lambda client: client.save_weights_for_sampler(req.path),
                lambda path: self._saved(req.model_id, path, {"path": path, "type": "save_weights_for_sampler"})))
        seq = req.sampling_session_seq_id

        def run(client: Any) -> Future:
            if seq is None:
                raise UserError("save_weights_for_sampler: needs path or sampling_session_seq_id")
            # a snapshot either way: `inflight` samplers also see the weights of this moment
            saved = client.save_weights_for_sampler(f"sampler-{seq}")
            return then(saved, lambda path: (path, self.service.create_sampling_client(model_path=path)), self.pool)

        def opened(result: tuple[str, Any]) -> JsonResult:
            path, client = result
            model = self.training.model(req.model_id)
            sampler_id = f"{model.session_id}:sample:{seq}"
            self.samplers.add(Sampler(sampler_id, model.session_id, client, model.spec.base_model, path))
            return self._saved(req.model_id, path, {"path": path, "sampling_session_id": sampler_id,
                                                    "type": "save_weights_for_sampler"})

        return _future(self.training.submit(req.model_id, req.seq_id, run, opened))

    # ---- sessions and sampling --------------------------------------------------------------

    def create_session(self) -> dict:
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = _Session()
        return {"type": "create_session", "session_id": session_id}

    def finish_session(self, session_id: str) -> None:
        """Mark a session finished (again: no-op) and close its models and samplers."""
        session = self.sessions[session_id]
        if session.finished:
            return
        session.finished = True
        self.training.close_session(session_id)
        self.samplers.close_session(session_id)

    async def create_sampling_session(self, req: sdk.CreateSamplingSessionRequest) -> dict:
        self.session(req.session_id)
        known = None if req.model_path is None else self.training.checkpoint_base_model(req.model_path)
        sampler_id = await self.samplers.create(req.session_id, req.sampling_session_seq_id, req.model_path,
                                                req.base_model, known)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def asample(self, req: sdk.SampleRequest) -> dict:
        request_id, sequence_ids = self.samplers.sample(req)
        return _future(request_id, sample_sequence_ids=sequence_ids)

    async def retrieve(self, req: sdk.FutureRetrieveRequest) -> Response:
        try:
            outcome = await self.futures.wait(req.request_id, self.cfg.poll_hold_s)
        except KeyError:
            return _error(f"unknown or expired request_id {req.request_id!r}", "user", 404)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"},
                                status_code=408)
        if isinstance(outcome, ProtoResult):
            return Response(outcome.payload, media_type="application/x-protobuf")
        if isinstance(outcome, JsonResult):
            return JSONResponse(outcome.payload)
        return JSONResponse({"error": outcome.message, "category": outcome.category})


def build_app(service: Any, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``service`` as configured; ConfigError if the model aliases name
    models the backend does not serve."""
    catalogue = ModelCatalogue(service.get_server_capabilities(), cfg.model_aliases, cfg.max_context_length)
    holder: dict[str, TinkerServer] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        holder["server"] = TinkerServer(service, cfg, catalogue)
        try:
            yield
        finally:
            holder.pop("server").close()

    app = FastAPI(title="meshrl serve (Tinker protocol)", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(UserError)
    async def user_error(_: Request, exc: UserError) -> JSONResponse:
        return _error(str(exc), "user", 400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path)
        bad = failure(exc)
        return _error(bad.message, bad.category, 500)

    def post(path: str, model: type[M], handler: Callable[[TinkerServer, M], Any]) -> None:
        async def route(request: Request) -> Any:
            result = handler(holder["server"], await _body(request, model))
            return await result if asyncio.iscoroutine(result) else result
        app.add_api_route(f"/api/v1/{path}", route, methods=["POST"], name=path)

    def heartbeat(server: TinkerServer, session_id: str) -> Any:
        session = server.sessions.get(session_id)
        if session is None:
            return _error(f"unknown session_id {session_id!r}", "user", 404)
        if session.finished:  # 410 stops the SDK's heartbeat loop
            return _error(f"session {session_id!r} has finished", "user", 410)
        session.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    post("client/config", sdk.ClientConfigRequest, lambda s, r: {"use_pyqwest_transport": False})
    post("client/dynamic_config", sdk.ClientConfigRequest, lambda s, r: {})
    post("create_session", sdk.CreateSessionRequest, lambda s, r: s.create_session())
    post("session_heartbeat", sdk.SessionHeartbeatRequest, lambda s, r: heartbeat(s, r.session_id))
    post("create_model", sdk.CreateModelRequest, TinkerServer.create_model)
    post("get_info", sdk.GetInfoRequest, lambda s, r: s.training.info(r.model_id))
    post("optim_step", sdk.OptimStepRequest, TinkerServer.optim_step)
    post("save_weights", sdk.SaveWeightsRequest, TinkerServer.save_weights)
    post("load_weights", sdk.LoadWeightsRequest, TinkerServer.load_weights)
    post("save_weights_for_sampler", sdk.SaveWeightsForSamplerRequest, TinkerServer.save_weights_for_sampler)
    post("create_sampling_session", sdk.CreateSamplingSessionRequest, TinkerServer.create_sampling_session)
    post("asample", sdk.SampleRequest, TinkerServer.asample)
    post("retrieve_future", sdk.FutureRetrieveRequest, TinkerServer.retrieve)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        msg = wire.forward_backward_request(await request.body(), request.headers.get("content-encoding"))
        return holder["server"].forward_backward(msg)

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": catalogue.capabilities()}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict:
        found = holder["server"].samplers.get(sampler_id)
        return {"sampler_id": found.sampler_id, "base_model": found.base_model, "model_path": found.model_path}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict:
        server = holder["server"]
        if session_id not in server.sessions:
            return _error(f"unknown session_id {session_id!r}", "user", 404)
        server.finish_session(session_id)
        return {}

    return app
