"""`MCPTools`: the tools of an MCP server (fastmcp's client), listed at start and called per turn
under a deadline, the server's death survived.

The server is one of
- a streamable-HTTP server the user runs (`url`);
- a command meshrl starts and restarts: over stdio (`command` alone), or an HTTP server that
  listens at `url` (`command` and `url`).

The client keeps one connection on an event loop of its own (a daemon thread); environment steps,
which run in worker threads, submit their calls to it. A call that fails for any reason other than
the tool's own error or its deadline means the connection (or the server) is gone: the provider is
marked broken and `ToolServerError` is raised, so the episode fails; `recover` then stops what is
left of the server, starts it again (a command) and reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import time
from typing import Any

from meshrl.envs.tools.providers import ToolFailed, ToolServerError, ToolTimedOut

log = logging.getLogger(__name__)


class MCPTools:
    """The tools of one MCP server, shared by the episodes of an env process."""

    def __init__(self, url: str | None, command: list[str] | None, env: dict[str, str], start_timeout_s: float,
                 label: str = "mcp"):
        if url is None and not command:
            raise ValueError("an MCP server needs a url (streamable HTTP) or a command (stdio, or HTTP with url)")
        self.url, self.command, self.env, self.start_timeout_s, self.label = url, command, env, start_timeout_s, label
        self.proc: subprocess.Popen | None = None
        self.client = None
        self.broken = False
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        self._schemas: list[dict] = []
        self._connect()

    def _run(self, coro, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _connect(self) -> None:
        """Start the server (a command), connect, and list its tools; RuntimeError in one line."""
        try:
            from fastmcp import Client
            from fastmcp.client.transports import StdioTransport
        except ImportError:
            raise RuntimeError(f"{self.label}: MCP tools need fastmcp (pip install 'meshrl[mcp]')") from None

        deadline = time.monotonic() + self.start_timeout_s
        if self.command and self.url:
            self.proc = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        transport = self.url if self.url else StdioTransport(self.command[0], self.command[1:],
                                                             env={**os.environ, **self.env}, keep_alive=False)
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.label}: the MCP server command exited with {self.proc.returncode}")
            client = Client(transport, init_timeout=max(1.0, deadline - time.monotonic()))
            try:
                self._run(client.__aenter__(), max(1.0, deadline - time.monotonic()))
                tools = self._run(client.list_tools(), max(1.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 -- the server is not up yet: try again until the deadline
                last = e
                time.sleep(0.2)
                continue
            self.client = client
            self._schemas = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema or {"type": "object", "properties": {}}}} for t in tools]
            self.broken = False
            return
        self._stop()
        raise RuntimeError(f"{self.label}: no MCP server answered within {self.start_timeout_s:g}s "
                           f"({type(last).__name__ if last else 'no attempt'}: {str(last)[:200] if last else ''})")

    def schemas(self) -> list[dict]:
        return list(self._schemas)

    @property
    def pid(self) -> int | None:
        """The server process meshrl started over HTTP (None for stdio or a user's server)."""
        return self.proc.pid if self.proc is not None else None

    def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        client = self.client
        if self.broken or client is None:
            raise ToolServerError(f"{self.label}: the MCP server is down")
        try:
            result = self._run(client.call_tool(name, arguments, timeout=timeout_s, raise_on_error=False), timeout_s + 2)
        except (TimeoutError, asyncio.TimeoutError):
            if self.proc is not None and self.proc.poll() is not None:
                self.broken = True
                raise ToolServerError(f"{self.label}: the MCP server exited with {self.proc.returncode}") from None
            raise ToolTimedOut(f"tool {name} gave no answer within {timeout_s:g}s") from None
        except Exception as e:  # noqa: BLE001 -- anything but the tool's own error: the connection is gone
            if "timed out" in str(e).lower() and (self.proc is None or self.proc.poll() is None):
                raise ToolTimedOut(f"tool {name} gave no answer within {timeout_s:g}s") from None
            self.broken = True
            raise ToolServerError(f"{self.label}: calling {name} failed ({type(e).__name__}: {str(e)[:200]})") from None
        text = "\n".join(getattr(c, "text", "") for c in result.content if getattr(c, "text", None) is not None)
        if result.is_error:
            raise ToolFailed(f"tool {name} failed: {text[:300]}")
        return text

    def recover(self) -> bool:
        """Restart a server that is gone (and reconnect); True if it was restarted."""
        with self._lock:
            dead = self.proc is not None and self.proc.poll() is not None
            if not (self.broken or dead):
                return False
            log.warning("%s: the MCP server is gone (%s); restarting it", self.label,
                        f"exit {self.proc.returncode}" if dead else "connection lost")
            self._stop()
            try:
                self._connect()
            except RuntimeError as e:
                self.broken = True
                log.warning("%s: restarting the MCP server failed: %s", self.label, e)
                return False
            return True

    def _stop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                self._run(client.__aexit__(None, None, None), 5.0)
                self._run(client.transport.close(), 5.0)  # a stdio server's process ends with it
            except Exception as e:  # noqa: BLE001 -- a dead connection has nothing left to close
                log.debug("closing the MCP client: %s", e)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            self.proc = None

    def close(self) -> None:
        self._stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
