"""Running the server: build the configured backend, serve the app with uvicorn until Ctrl-C or
SIGTERM, and shut down cleanly (pending polls get a few seconds, then the backend's training
clients are closed)."""

from __future__ import annotations

import asyncio
import importlib
import signal
from collections.abc import Callable
from typing import Any

import uvicorn

from meshrl.config.base import ConfigError
from meshrl.config.run import RunConfig

# seconds that open requests (long polls) get to finish once a stop is requested
SHUTDOWN_GRACE_S = 5


def load_backend(cfg: RunConfig) -> Any:
    """The service that `serve.backend` (`package.module:function`) builds from ``cfg``."""
    module_name, function_name = cfg.serve.backend.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"serve.backend = {cfg.serve.backend!r}: {exc}") from None
    return factory(cfg)


def run_server(app: Any, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, calling ``announce(url)`` once it listens (port 0
    picks a free port; the URL names the real one). Returns after a clean shutdown; raises
    ConfigError if the address cannot be bound."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    # uvicorn re-raises the signal that stopped it once it has shut down; these no-op handlers
    # (restored afterwards) make that a normal return instead of a KeyboardInterrupt or a kill
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(_serve(server, announce))
    except SystemExit as exc:  # uvicorn's startup failure (it has logged the reason)
        raise ConfigError(f"could not serve at {host}:{port} (exit status {exc.code})") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve(server: uvicorn.Server, announce: Callable[[str], None]) -> None:
    async def announce_once_listening() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        announce(f"http://{host}:{port}")

    watcher = asyncio.create_task(announce_once_listening())
    try:
        await server.serve()
    finally:
        watcher.cancel()
