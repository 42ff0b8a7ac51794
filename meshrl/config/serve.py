"""`meshrl serve`: the HTTP server that the Tinker SDK drives (``meshrl.serve``)."""

from __future__ import annotations

from pydantic import Field

from meshrl.config.base import Section

# Names tinker-cookbook recipes ask for (tinker_cookbook/model_info.py); all map to the served model.
COOKBOOK_MODEL_NAMES = (
    "Qwen/Qwen3-4B-Instruct-2507",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-8B-Base",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct",
)


class ServeLimits(Section):
    """What one request (and one tenant) may ask of the server. Every request is checked against
    these before any work is done for it; one over a limit fails with a `user` error (HTTP 4xx)
    naming the field and the limit. The defaults fit the cookbook recipes on the models served."""

    max_body_bytes: int = Field(64 << 20, ge=1024)
    """Largest request body as sent (compressed or not); a larger one is refused with 413 while it
    is read, before any of it is parsed."""

    max_decompressed_bytes: int = Field(256 << 20, ge=1024)
    """Largest zstd-compressed `forward_backward` body once inflated; checked while inflating, so a
    small body that would inflate past it is refused without being inflated whole."""

    max_lora_rank: int = Field(128, ge=1)
    """Largest LoRA rank `create_model` accepts."""

    max_tokens_per_datum: int = Field(32768, ge=1)
    """Most tokens in one training datum's `model_input`."""

    max_tokens_per_request: int = Field(262144, ge=1)
    """Most tokens over all datums of one `forward_backward` request."""

    max_datums_per_request: int = Field(4096, ge=1)
    """Most datums in one `forward_backward` request."""

    max_tensor_elements: int = Field(1 << 24, ge=1)
    """Most elements a declared tensor shape may have (a `loss_fn_inputs` tensor, dense or sparse,
    and `target_prompt_logprobs`); checked against the data sent before anything is allocated."""

    max_num_samples: int = Field(128, ge=1)
    """Most samples one `asample` request may ask for (`num_samples`)."""

    max_sample_tokens: int = Field(32768, ge=1)
    """Largest `sampling_params.max_tokens` of one sample request."""

    max_prompt_tokens: int = Field(32768, ge=1)
    """Most tokens in one sample request's prompt."""

    max_stop_sequences: int = Field(16, ge=0)
    """Most stop sequences (strings or token ids) in one sample request; a stop string may be at most
    256 characters."""

    max_metadata_bytes: int = Field(16384, ge=0)
    """Largest `user_metadata` (as JSON) of a session, a training model or a checkpoint."""

    max_sessions_per_tenant: int = Field(64, ge=1)
    """Most open (unfinished) sessions one tenant may hold."""

    max_finished_sessions_per_tenant: int = Field(256, ge=0)
    """Most finished sessions one tenant's records keep (with their training runs, for the
    listings); past it the oldest finished sessions that no saved checkpoint still needs are
    forgotten, so a tenant that opens and finishes sessions in a loop holds bounded memory."""

    max_models_per_tenant: int = Field(16, ge=1)
    """Most training models one tenant's open sessions may hold."""

    max_custom_loss_nodes: int = Field(2000, ge=1)
    """Most nodes in an uploaded custom-loss graph."""

    max_custom_loss_elements: int = Field(1 << 24, ge=1)
    """Most elements any one tensor a custom loss computes may have, for the shapes of the datums
    it is applied to: estimated from those shapes (without computing anything) before the loss
    runs."""

    max_pending_samples: int = Field(32, ge=1)
    """Most `asample` requests of one tenant in flight at once; the tenant's next one is refused
    (429) until one finishes, so no tenant's backlog can fill the generators' queue. The quotas and
    the share of the generators apply with `serve.keys_file` (an open server has one tenant)."""

    max_running_samples: int = Field(8, ge=1)
    """Most sample requests of one tenant running in the generators at once; its others wait in
    the sampler's queue and start as its running ones finish, behind no other tenant's. Another
    tenant's request, on the same weight version or another, waits for at most this many of them
    (one chunk of each: `sample_chunk_tokens`)."""

    sample_chunk_tokens: int = Field(32, ge=1)
    """Most tokens a tenant's sample request generates in one piece: a sample that reaches this
    many is continued by a request of its own (the prompt and its tokens so far), which waits its
    turn like any other. So another tenant's request, above all one on another weight version,
    waits for at most this many tokens of the requests running, however long they are; fewer
    tokens cost more prefill per sample. Seeded samples stay reproducible (the chunks' offsets do
    not depend on the load); with `serve.keys_file` only (an open server's requests run whole)."""

    version_hold_s: float = Field(0.5, ge=0)
    """How long the generators keep a weight version, once a tenant's last request on it has
    finished while another version waits, for that tenant's next request (when it has none
    waiting): a client sampling one request after another sends its next a moment after an answer,
    and switching away and back costs two weight loads. 0: switch at once. A tenant with a backlog
    is never waited for."""

    version_turn_s: float = Field(5.0, gt=0)
    """The longest a weight version keeps the generators by waiting so (`version_hold_s`) while
    another version waits: then the other version loads however soon the next request comes."""

    max_pending_training: int = Field(64, ge=1)
    """Most training requests (`forward_backward`, `optim_step`, saves and loads) of one tenant
    queued or running at once; the next one is refused (429) until one finishes."""


class ServeConfig(Section):
    """The Tinker-protocol server: where it listens, which backend it drives, which model names it
    answers to, and how long each wait may last."""

    host: str = "127.0.0.1"
    """Address to listen on (`0.0.0.0` for every interface)."""

    port: int = Field(8000, ge=0, le=65535)
    """TCP port (`meshrl serve --port` overrides it)."""

    backend: str = Field("meshrl.api:local_service", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """The backend factory as `package.module:function`, called with the RunConfig; it returns the
    service whose training and sampling clients the server drives."""

    model_aliases: dict[str, str | None] = Field(
        default_factory=lambda: {name: None for name in COOKBOOK_MODEL_NAMES})
    """Model names clients may ask for, each mapped to a model the backend serves (null: the one
    served model, `model.name_or_path`). Clients keep the name they asked for (it is what
    `get_info` and samplers report), so recipes that look models up by name keep working."""

    tokenizer: str | None = None
    """Tokenizer that `get_info` reports (a Hugging Face id or a local directory), so the SDK's
    `get_tokenizer()` loads the served model's vocabulary; None reports the backend's own (the
    served model's local directory; the fake backend has none, and the SDK then guesses one from
    the model name)."""

    keys_file: str | None = None
    """API keys that keep tenants apart: a text file of `<key> <tenant>` lines (`#` comments; keys
    start with `tml-`, as the SDK requires; a tenant may have several). With it, a request without
    a listed `X-API-Key` gets 401 and a tenant reaches only its own sessions, models, samplers and
    checkpoints (403 otherwise). None: the server runs open, for local use (any key; one tenant)."""

    max_context_length: int | None = Field(None, ge=1)
    """Context length advertised by `get_server_capabilities`; None advertises what the backend
    reports."""

    poll_hold_s: float = Field(30.0, gt=0, lt=45)
    """How long one `retrieve_future` poll waits for a pending result before answering 408 (the
    SDK polls again at once); below the SDK's 45 s poll timeout."""

    request_timeout_s: float = Field(3600.0, gt=0)
    """Deadline of one backend operation (model creation, forward_backward, sampling, a save);
    one that has not finished by then fails with a server error."""

    seq_gap_timeout_s: float = Field(60.0, gt=0)
    """How long a training request waits for an earlier `seq_id` of its model that has not
    arrived; then the waiting requests fail and the model's queue moves past the gap."""

    session_timeout_s: float = Field(300.0, gt=0)
    """A session whose client has sent no heartbeat for this long (the SDK sends one every 10 s) is
    finished: its training clients are closed and its samplers dropped."""

    result_ttl_s: float = Field(900.0, gt=0)
    """How long a finished result stays retrievable; later polls for it get 404."""

    limits: ServeLimits = ServeLimits()
    """What one request and one tenant may ask for (`serve.limits.*`)."""
