"""The Tinker-protocol HTTP server: a FastAPI app that the unmodified `tinker` SDK drives.

`build_app(service, cfg)` serves a backend (`meshrl.api`'s service, or the fake in
`meshrl.testing.fake_api`) under `/api/v1`: client configuration, sessions and heartbeats,
capabilities, training models (`create_model`, `get_info`, `forward_backward`, `optim_step`,
`save_weights`, `load_weights`, `save_weights_for_sampler`), uploaded custom losses
(`create_custom_loss`, `custom_losses`), sampling sessions
(`create_sampling_session`, `samplers/{id}`, `asample`) and `retrieve_future`, through which every
submitted request is answered. Request bodies are parsed with the SDK's own request models and
protobuf module, so a field the SDK renames fails loudly here.

It also serves the `RestClient` listings of a tenant's sessions, training runs and checkpoints
(`listing`), checkpoint deletion and expiry, and refuses every other SDK call in one line naming an
alternative (`REFUSED`).

Access (`tenants`): with `serve.keys_file` every request needs a listed `X-API-Key` (401) and
reaches only its own tenant's sessions, models, samplers, checkpoints and request ids (403); every
route is registered through `route`, which checks each id the request names before its handler
runs. Without a keys file the server says at start that it runs open.

Limits (`limits`, `serve.limits`): every body is read up to its size limit (and inflated up to
its own), and every request is checked against the limits before any work is done for it; a
tenant's sampling and training work in flight is held to its quotas, and the tenants take turns
at the learner (`turns`: one training call at a time, round-robin between tenants) and at the
generators (meshrl.api.sampler).

Errors: a request the SDK polls for fails through its future as ``{"error", "category"}``
(`user` for a bad request, `server` otherwise); a direct call answers 400 (user; 413 for a body
too large, 429 over a quota) or 500 (server) with the same body; a body that does not parse (not
JSON, not UTF-8, nested too deep) answers 400 naming the field. Messages are one line without
tracebacks or absolute paths; a server error names an id under which the log keeps the details.
None of these stop the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as sdk

from meshrl.api.errors import UserError
from meshrl.config.serve import ServeConfig
from meshrl.serve import limits, listing, wire
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.custom_losses import CustomLosses
from meshrl.serve.futures import FutureStore, JsonResult, ProtoResult, failure, one_line, then
from meshrl.serve.sampling import Sampler, Samplers
from meshrl.serve.tenants import (CHECKPOINT_PREFIX, OPEN_TENANT, REQUEST_ID_FIELD, AccessDenied, Forbidden, Keys,
                                  load_keys, resources, session_of)
from meshrl.serve.training import LoraSpec, SavedCheckpoint, TrainingModels
from meshrl.serve.turns import Turns

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)

# threads for the backend's blocking calls that are not a model's own (sampling clients, samples)
_POOL_THREADS = 8


# SDK calls this server does not serve: (method, path) -> the one-line refusal naming an alternative
REFUSED = {
    ("POST", "copy_weights"): "ServiceClient/RestClient.copy_weights is not served (there are no projects or "
                              "organisations to copy between); load your own checkpoint with "
                              "create_training_client_from_state",
    ("POST", "save_weights_external"): "TrainingClient.save_weights_external is not served (no external weights "
                                       "store); save_state and save_weights_for_sampler write tinker:// checkpoints",
    ("GET", "training_runs/{training_run_id}/checkpoints/{kind}/{name}/external_weights_urls"):
        "RestClient.get_external_weights_urls is not served (no external weights store); the server keeps "
        "checkpoints under its output.dir",
    ("POST", "training_runs/{training_run_id}/checkpoints/{kind}/{name}/publish"):
        "RestClient.publish_checkpoint_from_tinker_path is not served: checkpoints stay private to the tenant "
        "that saved them; use them from a client with that tenant's key",
    ("DELETE", "training_runs/{training_run_id}/checkpoints/{kind}/{name}/publish"):
        "RestClient.unpublish_checkpoint_from_tinker_path is not served: no checkpoint is ever public here",
    ("PUT", "sessions/{session_id}/project"): "RestClient.assign_session_project is not served (no projects; "
                                              "tenants come from serve.keys_file)",
    ("GET", "sessions/{session_id}/trace_export"): "RestClient.export_session_trace is not served (no traces are "
                                                   "recorded); use get_session and list_checkpoints",
    ("POST", "sessions/search"): "RestClient.search_sessions is not served; use RestClient.list_sessions and "
                                 "get_session",
    ("GET", "audit"): "AdminClient.get_audit_log is not served (no audit log); the server's log names failed requests",
    ("GET", "billing/usage/events"): "AdminClient.get_billing_usage is not served: nothing is billed here",
    ("GET", "billing/usage/checkpoints/current"): "AdminClient.get_current_checkpoint_storage_usage is not served; "
                                                  "RestClient.list_user_checkpoints lists your checkpoints",
    ("POST", "join_sampling_session"): "join_sampling_session is not served (client/config says "
                                       "sample_join_sampling_session: false)",
    ("POST", "retrieve_futures"): "retrieve_futures is not served (client/config says sample_use_retrieve_futures: "
                                  "false); poll retrieve_future",
    ("POST", "auth/token"): "JWT exchange is not served (client/config says pjwt_auth_enabled: false); send an "
                            "API key",
}


@dataclass
class _Session:
    tenant: str = OPEN_TENANT
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    finished_at: float = 0.0


@dataclass(frozen=True)
class Call:
    """One admitted request: the caller's tenant, its parsed body (None for a bodiless one), its
    URL parameters and its query."""

    tenant: str
    body: Any
    params: Mapping[str, str]
    query: Mapping[str, str]


def _error(message: str, category: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


async def _raw_body(request: Request, cfg: ServeConfig) -> bytes:
    """The request's body, read up to ``serve.limits.max_body_bytes`` (413 past it)."""
    return await limits.read_body(request.stream(), request.headers.get("content-length"),
                                  cfg.limits.max_body_bytes)


async def _body(request: Request, model: type[M], cfg: ServeConfig) -> M:
    """The JSON body validated as one of the SDK's request models; UserError naming the first bad
    field otherwise (also for a body that is not UTF-8 or nests too deep to parse)."""
    raw = await _raw_body(request, cfg)
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc).splitlines()[0][:200]
        raise UserError(f"{request.url.path}: body is not JSON ({reason})") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise UserError(f"{request.url.path}: {where}: {first['msg']}") from None
    except RecursionError:
        raise UserError(f"{request.url.path}: body nests too deep") from None


def _future(request_id: str, **extra: Any) -> dict:
    return {"request_id": request_id, **extra}


class TinkerServer:
    """The state behind the routes: sessions, training models, samplers and pending results.
    Built when the app starts, on its event loop."""

    def __init__(self, service: Any, cfg: ServeConfig, catalogue: ModelCatalogue, keys: Keys | None = None):
        loop = asyncio.get_running_loop()
        self.cfg = cfg
        self.keys = keys or Keys(None)
        self.catalogue = catalogue
        self.service = service
        self.futures = FutureStore(loop, cfg.result_ttl_s, cfg.request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="serve-pool")
        self.training = TrainingModels(service, catalogue, self.futures, cfg.seq_gap_timeout_s,
                                       cfg.tokenizer or service.tokenizer_id(), Turns(loop, cfg.request_timeout_s))
        self.samplers = Samplers(service, catalogue, self.futures, self.pool, cfg.request_timeout_s,
                                 cfg.limits.max_tensor_elements)
        self.sessions: dict[str, _Session] = {}
        self.custom_losses = CustomLosses(cfg.limits)
        self.limits = cfg.limits
        self.training_quota = limits.Quota("training requests", cfg.limits.max_pending_training,
                                           "max_pending_training")
        self.sampling_quota = limits.Quota("sample requests", cfg.limits.max_pending_samples, "max_pending_samples")
        self._reaper = loop.create_task(self._housekeeping())

    def close(self) -> None:
        self._reaper.cancel()
        self.training.close_all()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _housekeeping(self) -> None:
        """Finish the sessions whose clients stopped sending heartbeats (crashed or killed), so
        their training clients do not hold the backend forever, and delete expired checkpoints."""
        timeout = self.cfg.session_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 30.0))
            cutoff = time.monotonic() - timeout
            for session_id, session in list(self.sessions.items()):
                if not session.finished and session.last_seen < cutoff:
                    log.warning("session %s sent no heartbeat for %g s (serve.session_timeout_s): finishing it",
                                session_id, timeout)
                    self.finish_session(session_id)
            now = datetime.now(timezone.utc)
            for saved in list(self.training.checkpoints.values()):
                if saved.expires_at is not None and saved.expires_at <= now:
                    try:
                        await self.delete_checkpoint(saved.path)
                    except Exception:  # noqa: BLE001 - logged; the next round tries again
                        log.exception("deleting expired checkpoint %s failed", saved.path)

    # ---- access -----------------------------------------------------------------------------

    def owner(self, field_name: str, value: str) -> str | None:
        """The tenant that owns the resource a request field names; None if nobody known does."""
        if field_name == REQUEST_ID_FIELD:
            return self.futures.owner(value)
        session = self.sessions.get(session_of(value))
        return None if session is None else session.tenant

    def admit(self, tenant: str, named: Mapping[str, str]) -> None:
        """Forbidden unless every resource the request names is the tenant's own or unknown (an
        unknown id fails in its handler). With keys, a checkpoint path must be one this tenant's
        sessions saved: other files under the checkpoint root have no known owner."""
        for field_name, value in named.items():
            if field_name in ("path", "model_path", "tinker_path") and not value.startswith(CHECKPOINT_PREFIX):
                continue  # a checkpoint's name, not a path
            owner = self.owner(field_name, value)
            if owner is None and value.startswith(CHECKPOINT_PREFIX) and not self.keys.open:
                raise Forbidden(f"{field_name} {value!r}: not a checkpoint of tenant {tenant!r} "
                                "(only checkpoints your own sessions saved on this server can be used)")
            if owner is not None and owner != tenant:
                raise Forbidden(f"{field_name} {value!r} belongs to another tenant")

    def session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"unknown session_id {session_id!r}")
        if session.finished:
            raise UserError(f"session {session_id!r} has finished")
        return session

    # ---- training ---------------------------------------------------------------------------

    def create_model(self, req: sdk.CreateModelRequest) -> dict:
        session = self.session(req.session_id)
        if req.lora_config is None:
            raise UserError("create_model: full fine-tuning (no lora_config) is not served; "
                            "use create_lora_training_client")
        optimizer = wire.optimizer_type("create_model", req.optimizer_config)
        lora = req.lora_config
        limits.lora("create_model", lora, self.limits)
        limits.metadata("create_model: user_metadata", req.user_metadata, self.limits)
        self._room_for_a_model(session.tenant, req.session_id, req.model_seq_id)
        spec = LoraSpec(req.base_model, lora.rank, lora.seed, lora.train_mlp, lora.train_attn, lora.train_unembed,
                        optimizer)
        request_id, model_id = self.training.create(req.session_id, req.model_seq_id, spec, req.user_metadata,
                                                    session.tenant)
        return _future(request_id, model_id=model_id)

    def forward_backward(self, msg: Any) -> dict:
        call = "forward" if msg.forward_only else "forward_backward"

        def run(client: Any) -> Future:
            data = wire.datums(msg, self.limits)
            config = wire.loss_fn_config(msg)
            session_id = self.training.model(msg.model_id).session_id
            if msg.loss_fn == "stable_reinforce":  # the sampler's records, named by each datum's provenance
                data = self.samplers.stability.resolve(session_id, data, wire.provenance(msg))
            if msg.loss_fn == "custom":  # an uploaded loss, named by its id: its graph, sized for these datums
                config = self.custom_losses.config(session_id, config, data)
            return getattr(client, call)(data, msg.loss_fn, config)

        return _future(self._submit(msg.model_id, msg.seq_id, run,
                                            lambda out: ProtoResult(wire.forward_backward_output(out))))

    def create_custom_loss(self, req: sdk.CreateCustomLossRequest) -> dict:
        self.session(req.session_id)
        request_id = self.futures.create()
        self.futures.settle(request_id, JsonResult({"loss_id": self.custom_losses.create(req),
                                                    "type": "create_custom_loss"}))
        return _future(request_id)

    def _submit(self, model_id: str, seq_id: int | None, operation: Any, encode: Any) -> str:
        """`TrainingModels.submit`, counted against the model's tenant's quota of training work in
        flight (`serve.limits.max_pending_training`) until the backend call is done (with keys:
        an open server has one tenant)."""
        session = self.sessions.get(session_of(model_id))
        shared = session is not None and not self.keys.open  # an open server has one tenant: nothing to share
        release = self.training_quota.take(session.tenant) if shared else None
        return self.training.submit(model_id, seq_id, operation, encode, release)

    def _room_for_a_model(self, tenant: str, session_id: str, model_seq_id: int) -> None:
        """OverLimit if ``tenant``'s open sessions hold ``serve.limits.max_models_per_tenant``
        models already (a retried creation of one of them is not a new one)."""
        if f"{session_id}:train:{model_seq_id}" in self.training.runs:
            return
        held = sum(1 for run in self.training.runs.values()
                   if not self.sessions[run.session_id].finished and self.sessions[run.session_id].tenant == tenant)
        limits.at_most("create_model: training models of this tenant's open sessions", held + 1,
                       self.limits.max_models_per_tenant, "max_models_per_tenant")

    def optim_step(self, req: sdk.OptimStepRequest) -> dict:
        def run(client: Any) -> Future:
            return client.optim_step(wire.optim_params(req.optim_params))

        return _future(self._submit(req.model_id, req.seq_id, run, lambda metrics: JsonResult(
            {"metrics": {key: float(value) for key, value in (metrics or {}).items()}})))

    def save_weights(self, req: sdk.SaveWeightsRequest) -> dict:
        limits.checkpoint_name("save_weights", req.path)
        limits.metadata("save_weights: user_metadata", req.user_metadata, self.limits)

        def run(client: Any) -> Future:
            if not req.path:
                raise UserError("save_weights: path (the checkpoint name) is missing")
            existing = listing.checkpoint_path(req.model_id, f"weights/{req.path}")
            if not req.overwrite and existing in self.training.checkpoints:
                raise UserError(f"save_weights: {existing} exists; pass overwrite=True or another name")
            return client.save_state(req.path)

        return _future(self._submit(req.model_id, req.seq_id, run, lambda path: self._saved(
            req.model_id, path, {"path": path, "type": "save_weights"}, req.ttl_seconds, req.user_metadata)))

    def _saved(self, model_id: str, path: str, reply: dict, ttl_seconds: int | None,
               user_metadata: dict[str, str] | None) -> JsonResult:
        self.training.remember_checkpoint(model_id, path, ttl_seconds, user_metadata)
        return JsonResult(reply)

    def load_weights(self, req: sdk.LoadWeightsRequest) -> dict:
        if req.model_id is None:  # create-via-load: a new training client from a checkpoint
            optimizer = _load_options_served(req)
            if req.session_id is None or req.model_seq_id is None:
                raise UserError("load_weights: needs model_id, or session_id with model_seq_id")
            limits.metadata("load_weights: user_metadata", req.user_metadata, self.limits)
            tenant = self.session(req.session_id).tenant
            self._room_for_a_model(tenant, req.session_id, req.model_seq_id)
            return _future(self.training.create_from_checkpoint(req.session_id, req.model_seq_id, req.path,
                                                                req.optimizer, req.base_model, req.user_metadata,
                                                                optimizer, tenant))

        def run(client: Any) -> Future:
            _load_options_served(req)
            return client.load_state_with_optimizer(req.path) if req.optimizer else client.load_state(req.path)

        return _future(self._submit(req.model_id, req.seq_id, run, lambda _: JsonResult(
            {"path": req.path, "model_id": req.model_id, "type": "load_weights"})))

    def save_weights_for_sampler(self, req: sdk.SaveWeightsForSamplerRequest) -> dict:
        """A named sampler checkpoint (``path``), or a sampling session on the current weights
        (``sampling_session_seq_id``): a snapshot of them, or with ``kind='inflight'`` a sampler
        that samples the model's newest inflight save at each request (these weights or newer)."""
        limits.checkpoint_name("save_weights_for_sampler", req.path)
        limits.metadata("save_weights_for_sampler: user_metadata", req.user_metadata, self.limits)

        def named(client: Any) -> Future:
            if req.kind != "snapshot":
                raise UserError(f"save_weights_for_sampler: kind={req.kind!r} applies to a sampling session "
                                "(save_weights_and_get_sampling_client), not to a named save; use kind='snapshot'")
            return client.save_weights_for_sampler(req.path)

        if req.path is not None:
            return _future(self._submit(
                req.model_id, req.seq_id, named,
                lambda path: self._saved(req.model_id, path, {"path": path, "type": "save_weights_for_sampler"},
                                         req.ttl_seconds, req.user_metadata)))
        seq = req.sampling_session_seq_id

        def run(client: Any) -> Future:
            if seq is None:
                raise UserError("save_weights_for_sampler: needs path or sampling_session_seq_id")
            saved = client.save_weights_for_sampler(f"sampler-{seq}", req.kind)
            return then(saved, lambda path: (path, client.inflight_sampling_client() if req.kind == "inflight" else
                                             self.service.create_sampling_client(model_path=path)), self.pool)

        def opened(result: tuple[str, Any]) -> JsonResult:
            path, client = result
            model = self.training.model(req.model_id)
            sampler_id = f"{model.session_id}:sample:{seq}"
            self.samplers.add(Sampler(sampler_id, model.session_id, client, model.spec.base_model, path))
            return self._saved(req.model_id, path, {"path": path, "sampling_session_id": sampler_id,
                                                    "type": "save_weights_for_sampler"},
                               req.ttl_seconds, req.user_metadata)

        return _future(self._submit(req.model_id, req.seq_id, run, opened))

    # ---- sessions and sampling --------------------------------------------------------------

    def create_session(self, tenant: str, user_metadata: dict[str, Any] | None = None,
                       display_name: str | None = None, project_id: str | None = None) -> dict:
        if project_id is not None:
            raise UserError(f"create_session: project_id {project_id!r} is not served (no projects here; tenants "
                            "come from serve.keys_file); unset project_id / TINKER_PROJECT_ID")
        limits.metadata("create_session: user_metadata and display_name", [user_metadata, display_name],
                        self.limits)
        held = sum(1 for session in self.sessions.values() if session.tenant == tenant and not session.finished)
        limits.at_most("create_session: open sessions of this tenant", held + 1, self.limits.max_sessions_per_tenant,
                       "max_sessions_per_tenant")
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = _Session(tenant, user_metadata, display_name)
        return {"type": "create_session", "session_id": session_id}

    def finish_session(self, session_id: str) -> None:
        """Mark a session finished (again: no-op) and close its models and samplers."""
        session = self.sessions[session_id]
        if session.finished:
            return
        session.finished, session.finished_at = True, time.monotonic()
        self.training.close_session(session_id)
        self.samplers.close_session(session_id)
        self.custom_losses.close_session(session_id)
        self._forget_finished(session.tenant)

    def _forget_finished(self, tenant: str) -> None:
        """Forget ``tenant``'s oldest finished sessions past `max_finished_sessions_per_tenant`, with
        their training runs; a session that saved a checkpoint still kept is kept (it owns it)."""
        finished = sorted((s.finished_at, sid) for sid, s in self.sessions.items() if s.tenant == tenant and s.finished)
        excess = len(finished) - self.limits.max_finished_sessions_per_tenant
        for _, session_id in finished:
            if excess <= 0:
                break
            if not self.training.saved_by(session_id):
                del self.sessions[session_id]
                self.training.forget_session(session_id)
                excess -= 1

    async def create_sampling_session(self, req: sdk.CreateSamplingSessionRequest) -> dict:
        self.session(req.session_id)
        known = None if req.model_path is None else self.training.checkpoint_base_model(req.model_path)
        sampler_id = await self.samplers.create(req.session_id, req.sampling_session_seq_id, req.model_path,
                                                req.base_model, known)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def asample(self, tenant: str, req: sdk.SampleRequest) -> dict:
        limits.sample(req, self.limits)
        if self.keys.open:  # one tenant: no quota, no share of the generators to keep
            request_id, sequence_ids = self.samplers.sample(req, None, lambda: None)
        else:
            request_id, sequence_ids = self.samplers.sample(req, tenant, self.sampling_quota.take(tenant))
        return _future(request_id, sample_sequence_ids=sequence_ids)

    # ---- RestClient: listings, deletion, expiry ------------------------------------------------

    def list_sessions(self, call: Call) -> dict:
        limit, offset = listing.page_bounds(dict(call.query), 20)
        owned = [sid for sid, session in reversed(self.sessions.items()) if session.tenant == call.tenant]
        return {"sessions": listing.page(owned, limit, offset)[0]}

    def get_session(self, session_id: str) -> dict:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"unknown session_id {session_id!r}")
        runs = [run_id for run_id, run in self.training.runs.items() if run.session_id == session_id]
        return {"training_run_ids": runs, "sampler_ids": self.samplers.ids_of(session_id),
                "user_metadata": session.user_metadata, "display_name": session.display_name}

    def training_run(self, model_id: str) -> dict:
        run = self.training.runs.get(model_id)
        if run is None:
            raise UserError(f"unknown training_run_id {model_id!r}")
        return listing.training_run(run, self.sessions[run.session_id].tenant, self._checkpoints_of(model_id))

    def list_training_runs(self, call: Call) -> dict:
        if "project_id" in call.query:
            raise UserError("list_training_runs: project_id is not served (no projects here); leave it unset")
        limit, offset = listing.page_bounds(dict(call.query), 20)
        owned = [model_id for model_id, run in reversed(self.training.runs.items())
                 if self.sessions[run.session_id].tenant == call.tenant]
        runs, cursor = listing.page(owned, limit, offset)
        return {"training_runs": [self.training_run(model_id) for model_id in runs], "cursor": cursor}

    def _checkpoints_of(self, model_id: str) -> list[SavedCheckpoint]:
        return [saved for saved in self.training.checkpoints.values() if saved.model_id == model_id]

    def list_checkpoints(self, model_id: str) -> dict:
        if model_id not in self.training.runs:
            raise UserError(f"unknown training_run_id {model_id!r}")
        return {"checkpoints": [c.sdk() for c in listing.newest_first(self._checkpoints_of(model_id))]}

    def list_user_checkpoints(self, call: Call) -> dict:
        limit, offset = listing.page_bounds(dict(call.query), 100)
        owned = [c for c in listing.newest_first(self.training.checkpoints.values())
                 if self.owner("path", c.path) == call.tenant]
        saved, cursor = listing.page(owned, limit, offset)
        return {"checkpoints": [c.sdk() for c in saved], "cursor": cursor}

    def saved_checkpoint(self, path: str) -> SavedCheckpoint:
        saved = self.training.checkpoints.get(path)
        if saved is None:
            raise UserError(f"unknown checkpoint {path!r} (not saved through this server, or deleted)")
        return saved

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> dict:
        self.saved_checkpoint(path).expire_after(ttl_seconds)
        return {}

    async def delete_checkpoint(self, path: str) -> dict:
        """Delete a checkpoint's files and forget it (samplers already made from it keep sampling)."""
        self.saved_checkpoint(path)
        await asyncio.get_running_loop().run_in_executor(self.pool, self.service.delete_checkpoint, path)
        self.training.checkpoints.pop(path, None)
        return {}

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


def _load_options_served(req: sdk.LoadWeightsRequest) -> str | None:
    """The optimizer a weights-only create-via-load asks for (None: not given); UserError for an
    option not served, or an optimizer_config that would override a restored or existing one."""
    if req.weights_access_token is not None:
        raise UserError("load_weights: weights_access_token is not served (no cross-organisation access); "
                        "load checkpoints your own tenant saved")
    if req.optimizer_config is None:
        return None
    if req.model_id is not None:
        raise UserError("load_weights: optimizer_config applies to a new training client; a loaded model keeps "
                        "the optimizer it was created with")
    if req.optimizer:
        raise UserError("load_weights: optimizer_config cannot override the optimizer restored with its state "
                        "(optimizer=True)")
    return wire.optimizer_type("load_weights", req.optimizer_config)


Handler = Callable[[TinkerServer, Call], Any]
Parser = Callable[[Request], Awaitable[Any]]


def _forward_backward_body(cfg: ServeConfig, admit: Callable[[Request, Mapping[str, str]], None]) -> Parser:
    async def parse(request: Request) -> Any:
        """The protobuf body, inflated and parsed on a worker thread (up to the limits' sizes: a
        large one keeps the event loop, and the other tenants' requests, waiting for nothing), once
        the model it names (read from its first bytes) is the caller's own."""
        body = await _raw_body(request, cfg)
        encoding = request.headers.get("content-encoding")
        admit(request, {"model_id": wire.leading_model_id(body, encoding)})
        return await asyncio.to_thread(wire.forward_backward_request, body, encoding,
                                       cfg.limits.max_decompressed_bytes)
    return parse


def _refuse(message: str) -> Handler:
    def refuse(server: TinkerServer, call: Call) -> Any:
        raise UserError(message)
    return refuse


def build_app(service: Any, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``service`` as configured; ConfigError if the model aliases name
    models the backend does not serve, or the keys file is unreadable or malformed."""
    catalogue = ModelCatalogue(service.get_server_capabilities(), cfg.model_aliases, cfg.max_context_length)
    keys = Keys(None if cfg.keys_file is None else load_keys(cfg.keys_file))
    (log.warning if keys.open else log.info)("%s", keys.describe())
    holder: dict[str, TinkerServer] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        holder["server"] = TinkerServer(service, cfg, catalogue, keys)
        try:
            yield
        finally:
            holder.pop("server").close()

    async def authenticate(request: Request) -> None:
        """Every route's first step: the tenant of the request's key (401 without a known one)."""
        request.state.tenant = keys.tenant(request.headers.get("x-api-key"))

    app = FastAPI(title="meshrl serve (Tinker protocol)", lifespan=lifespan, docs_url=None, redoc_url=None,
                  dependencies=[Depends(authenticate)])

    @app.exception_handler(AccessDenied)
    async def access_denied(_: Request, exc: AccessDenied) -> JSONResponse:
        return _error(one_line(str(exc)), "user", exc.status)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        status = getattr(exc, "status", 400)
        if status != 400:  # a refusal for size or quota: the operator sees who hits the limits
            log.warning("%s refused (%d) for tenant %r: %s", request.url.path, status,
                        getattr(request.state, "tenant", None), exc)
        return _error(one_line(str(exc)), "user", status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s failed", request.url.path)
        bad = failure(exc)  # logs the error with its traceback under the id it names
        return _error(bad.message, bad.category, 500)

    def route(method: str, path: str, handler: Handler, body: type[pydantic.BaseModel] | Parser | None = None) -> None:
        """Serve ``handler`` at ``/api/v1/{path}``: the request's body is parsed (an SDK request
        model, or a parser), every id it or its URL names is checked against the caller's tenant,
        and a request id in the reply is recorded as the caller's."""
        async def endpoint(request: Request) -> Any:
            server, tenant = holder["server"], request.state.tenant
            if body is None:
                parsed = None
            elif isinstance(body, type):
                parsed = await _body(request, body, cfg)
            else:
                parsed = await body(request)
            server.admit(tenant, resources(parsed, request.path_params))
            result = handler(server, Call(tenant, parsed, request.path_params, request.query_params))
            if asyncio.iscoroutine(result):
                result = await result
            if isinstance(result, dict) and REQUEST_ID_FIELD in result:
                server.futures.claim(result[REQUEST_ID_FIELD], tenant)
            return result
        endpoint.admits_tenants = True  # what tests/test_serve_tenants.py checks every route for
        app.add_api_route(f"/api/v1/{path}", endpoint, methods=[method], name=f"{method} {path}")

    def post(path: str, model: type[M], handler: Callable[[TinkerServer, M], Any]) -> None:
        route("POST", path, lambda server, call: handler(server, call.body), model)

    def heartbeat(server: TinkerServer, session_id: str) -> Any:
        session = server.sessions.get(session_id)
        if session is None:
            return _error(f"unknown session_id {session_id!r}", "user", 404)
        if session.finished:  # 410 stops the SDK's heartbeat loop
            return _error(f"session {session_id!r} has finished", "user", 410)
        session.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    def finish(server: TinkerServer, session_id: str) -> Any:
        if session_id not in server.sessions:
            return _error(f"unknown session_id {session_id!r}", "user", 404)
        server.finish_session(session_id)
        return {}

    def sampler(server: TinkerServer, sampler_id: str) -> dict:
        found = server.samplers.get(sampler_id)
        return {"sampler_id": found.sampler_id, "base_model": found.base_model, "model_path": found.model_path}

    def checkpoint(call: Call) -> str:
        return listing.checkpoint_path(call.params["training_run_id"], f"{call.params['kind']}/{call.params['name']}")

    post("client/config", sdk.ClientConfigRequest,
         lambda s, r: {"use_pyqwest_transport": False, "custom_loss_server_side": True})
    post("client/dynamic_config", sdk.ClientConfigRequest, lambda s, r: {})
    route("POST", "create_session", lambda s, c: s.create_session(c.tenant, c.body.user_metadata, c.body.display_name,
                                                                  c.body.project_id), sdk.CreateSessionRequest)
    post("session_heartbeat", sdk.SessionHeartbeatRequest, lambda s, r: heartbeat(s, r.session_id))
    post("create_model", sdk.CreateModelRequest, TinkerServer.create_model)
    post("get_info", sdk.GetInfoRequest, lambda s, r: s.training.info(r.model_id))
    def admit_early(request: Request, named: Mapping[str, str]) -> None:
        """The ownership check of a body's leading ids, before the body is decoded (the route
        checks every id again once it is)."""
        holder["server"].admit(request.state.tenant, named)

    route("POST", "forward_backward", lambda s, c: s.forward_backward(c.body), _forward_backward_body(cfg, admit_early))
    post("create_custom_loss", sdk.CreateCustomLossRequest, TinkerServer.create_custom_loss)
    post("optim_step", sdk.OptimStepRequest, TinkerServer.optim_step)
    post("save_weights", sdk.SaveWeightsRequest, TinkerServer.save_weights)
    post("load_weights", sdk.LoadWeightsRequest, TinkerServer.load_weights)
    post("save_weights_for_sampler", sdk.SaveWeightsForSamplerRequest, TinkerServer.save_weights_for_sampler)
    post("create_sampling_session", sdk.CreateSamplingSessionRequest, TinkerServer.create_sampling_session)
    route("POST", "asample", lambda s, c: s.asample(c.tenant, c.body), sdk.SampleRequest)
    post("retrieve_future", sdk.FutureRetrieveRequest, TinkerServer.retrieve)
    route("POST", "telemetry", lambda s, c: {"status": "accepted"})
    route("GET", "healthz", lambda s, c: {"status": "ok"})
    route("GET", "get_server_capabilities", lambda s, c: {"supported_models": catalogue.capabilities()})
    route("GET", "samplers/{sampler_id}", lambda s, c: sampler(s, c.params["sampler_id"]))
    route("POST", "sessions/{session_id}/finish", lambda s, c: finish(s, c.params["session_id"]))
    route("GET", "sessions", TinkerServer.list_sessions)
    route("GET", "sessions/{session_id}", lambda s, c: s.get_session(c.params["session_id"]))
    route("GET", "training_runs", TinkerServer.list_training_runs)
    route("GET", "training_runs/{training_run_id}", lambda s, c: s.training_run(c.params["training_run_id"]))
    route("GET", "training_runs/{training_run_id}/checkpoints",
          lambda s, c: s.list_checkpoints(c.params["training_run_id"]))
    route("GET", "checkpoints", TinkerServer.list_user_checkpoints)
    route("DELETE", "training_runs/{training_run_id}/checkpoints/{kind}/{name}",
          lambda s, c: s.delete_checkpoint(checkpoint(c)))
    route("PUT", "training_runs/{training_run_id}/checkpoints/{kind}/{name}/ttl",
          lambda s, c: s.set_checkpoint_ttl(checkpoint(c), c.body.ttl_seconds), listing.CheckpointTtlRequest)
    route("POST", "weights_info", lambda s, c: listing.weights_info(s.saved_checkpoint(c.body.tinker_path)),
          listing.WeightsInfoRequest)
    for (method, path), message in REFUSED.items():
        route(method, path, _refuse(message))
    return app
