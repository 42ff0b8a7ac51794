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
