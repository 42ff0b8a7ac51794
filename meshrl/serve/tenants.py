"""Who may call the server, and what each caller may reach.

`serve.keys_file` names a text file of API keys, one ``<key> <tenant>`` pair a line (blank lines
and lines starting with ``#`` are skipped; a tenant may hold several keys). With it, every request
must carry a listed key in ``X-API-Key`` (401 otherwise), and a tenant reaches only what its own
sessions made (403 otherwise). Without it the server is open, for local use: any key or none is
accepted and every caller is the one tenant ``local``.

What a tenant owns follows from the ids the server hands out: a session is recorded with the tenant
that created it, and everything else names its session: training models ``{session}:train:{n}``,
samplers ``{session}:sample:{n}`` and checkpoints ``tinker://{model id}/{kind}/{name}``. Request
ids are recorded with the tenant they were returned to. `resources` picks every such id out of a
request, so one check in front of every route covers all of them.

Keys are secrets: no message, exception or log line written here contains one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshrl.config.base import ConfigError

OPEN_TENANT = "local"
"""The one tenant of a server without a keys file."""

KEY_PREFIX = "tml-"
"""The SDK sends only keys that start with this (it refuses others before any request)."""

# request fields (and URL parameters) that name something a tenant owns
RESOURCE_FIELDS = ("session_id", "model_id", "sampling_session_id", "sampler_id", "training_run_id",
                   "path", "model_path", "tinker_path")
REQUEST_ID_FIELD = "request_id"
_TENANT = re.compile(r"^[A-Za-z0-9_.@-]+$")
CHECKPOINT_PREFIX = "tinker://"


class AccessDenied(Exception):
    """A request refused before it reaches a handler; ``status`` is its HTTP status."""

    status = 403


class Unauthorized(AccessDenied):
    status = 401


class Forbidden(AccessDenied):
    status = 403


def load_keys(path: str | Path) -> dict[str, str]:
    """The key -> tenant map of a keys file; ConfigError naming the line (never the key) when a
    line is malformed, a key repeats or lacks the SDK's ``tml-`` prefix."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"serve.keys_file = {str(path)!r}: cannot read it ({exc.strerror})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"serve.keys_file {str(path)!r} line {number}"
        if len(words) != 2:
            raise ConfigError(f"{where}: expected '<key> <tenant>', got {len(words)} fields")
        key, tenant = words
        if not key.startswith(KEY_PREFIX):
            raise ConfigError(f"{where}: the key does not start with {KEY_PREFIX!r} (the SDK sends no other keys)")
        if not _TENANT.match(tenant):
            raise ConfigError(f"{where}: tenant {tenant!r} may only use letters, digits and _ . @ -")
        if key in keys:
            raise ConfigError(f"{where}: this key is already listed on an earlier line")
        keys[key] = tenant
    if not keys:
        raise ConfigError(f"serve.keys_file {str(path)!r}: lists no keys")
    return keys


class Keys:
    """The tenant each API key stands for; ``None`` keys: an open server."""

    def __init__(self, keys: Mapping[str, str] | None):
        self._keys = dict(keys) if keys is not None else None

    @property
    def open(self) -> bool:
        return self._keys is None

    def describe(self) -> str:
        """One line for the server's start (counts, never keys)."""
        if self._keys is None:
            return ("no serve.keys_file: the server runs open, for local use (any API key is accepted and every "
                    f"caller is the tenant {OPEN_TENANT!r})")
        return f"serve.keys_file: {len(self._keys)} keys of {len(set(self._keys.values()))} tenants"

    def tenant(self, key: str | None) -> str:
        """The tenant of a request's ``X-API-Key``; Unauthorized for a missing or unknown key."""
        if self._keys is None:
            return OPEN_TENANT
        if not key:
            raise Unauthorized("missing X-API-Key: this server needs a key listed in its serve.keys_file "
                               "(set TINKER_API_KEY)")
        tenant = self._keys.get(key)
        if tenant is None:
            raise Unauthorized("unknown API key: it is not listed in this server's serve.keys_file "
                               "(check TINKER_API_KEY)")
        return tenant


def resources(request: Any, params: Mapping[str, str]) -> dict[str, str]:
    """Every id in a request that names something a tenant owns: the URL's parameters and the
    body's fields of those names (a pydantic model or a protobuf message), when set."""
    found = {name: value for name, value in params.items() if name in (*RESOURCE_FIELDS, REQUEST_ID_FIELD)}
    for name in (*RESOURCE_FIELDS, REQUEST_ID_FIELD):
        value = getattr(request, name, None) if request is not None else None
        if isinstance(value, str) and value:
            found[name] = value
    return found


def session_of(resource: str) -> str:
    """The session a resource id names: a session id itself, a model or sampler id
    (``{session}:train:{n}``, ``{session}:sample:{n}``) or a checkpoint path
    (``tinker://{model id}/...``)."""
    if resource.startswith(CHECKPOINT_PREFIX):
        resource = resource[len(CHECKPOINT_PREFIX):].split("/", 1)[0]
    return resource.split(":", 1)[0]
