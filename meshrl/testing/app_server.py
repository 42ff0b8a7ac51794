"""An ASGI app (e.g. `meshrl serve`'s) served by uvicorn on a free loopback port in a thread of this
process, so a test can drive it over real HTTP (the `tinker` SDK) and still read the backend's
state and the server's log records."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_in_thread(app: Any, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL. Raises if it does not start, or
    does not stop within 20 s."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the app server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the app server did not stop")
