"""Configuration of one external teacher: an OpenAI-compatible chat endpoint (used by trace replay,
channel 3, and by the optional LLM hint generator of the SDPO channel).

API keys never appear in a config: a teacher names the environment variable that holds its key,
and the key is read from the environment at request time.
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from meshrl.config.base import Section

ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TeacherEndpointConfig(Section):
    """One OpenAI-compatible chat endpoint used as a teacher (or as the hint model)."""

    name: str = Field(min_length=1)
    """Short unique name of the teacher, used in counters, logs and pair provenance."""

    base_url: str
    """Endpoint root including the API version, e.g. ``https://api.openai.com/v1``; requests go to
    ``{base_url}/chat/completions``. Must be http(s) and carry no credentials."""

    model: str = Field(min_length=1)
    """Model name sent in the request body."""

    api_key_env: str = ""
    """Name of the environment variable holding the API key (never the key itself); empty for an
    endpoint without authentication."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Time limit of one HTTP attempt, in seconds (retries each get their own)."""

    max_concurrency: int = Field(default=4, ge=1)
    """Most requests in flight to this endpoint at once (per client)."""

    max_retries: int = Field(default=3, ge=0)
    """Retries after the first attempt on timeout, 429, 5xx and connection errors."""

    backoff_base_s: float = Field(default=0.5, gt=0)
    """Backoff before retry n is up to ``backoff_base_s * 2**(n-1)`` seconds."""

    backoff_max_s: float = Field(default=30.0, gt=0)
    """Cap on any backoff, including a server's Retry-After."""

    jitter: bool = True
    """Full jitter: sleep a uniform random time between 0 and the backoff (else the backoff itself)."""

    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature requested from the teacher."""

    max_tokens: int = Field(default=1024, ge=1)
    """Most completion tokens requested from the teacher."""

    price_prompt_per_1m_usd: float = Field(default=0.0, ge=0)
    """Price in USD per million prompt tokens, for the spend budget."""

    price_completion_per_1m_usd: float = Field(default=0.0, ge=0)
    """Price in USD per million completion tokens, for the spend budget."""

    @model_validator(mode="before")
    @classmethod
    def _hide_misplaced_key(cls, data: Any) -> Any:
        # A value that is not an environment variable name is most likely a pasted key: replace it
        # before validation so the validation error (which echoes the input) cannot print it.
        if isinstance(data, dict):
            env = data.get("api_key_env")
            if isinstance(env, str) and env and not ENV_VAR_NAME.fullmatch(env):
                data = {**data, "api_key_env": "<redacted: not an environment variable name>"}
        return data

    @field_validator("api_key_env")
    @classmethod
    def _check_env_name(cls, value: str) -> str:
        if value and not ENV_VAR_NAME.fullmatch(value):
            raise ValueError("the name of an environment variable holding the key, not the key itself")
        return value

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http(s) URL such as https://api.example.com/v1")
        if parts.username or parts.password:
            raise ValueError("a URL without credentials (use api_key_env)")
        if parts.query or parts.fragment:
            raise ValueError("a URL without query or fragment")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _check_backoff(self) -> TeacherEndpointConfig:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff_max_s must be >= backoff_base_s")
        return self
