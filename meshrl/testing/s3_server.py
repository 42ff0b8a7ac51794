"""A real S3 protocol endpoint on loopback for tests: moto's server mode in a child process,
reached through s3fs, stopped by its PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx

from meshrl.testing.ports import free_port

CREDENTIALS = {"key": "testing", "secret": "testing"}


class MotoS3Server:
    """``with MotoS3Server() as s3:`` -> ``s3.url(prefix)`` and ``s3.storage_options`` for a fresh
    bucket on a loopback moto server."""

    def __init__(self, timeout_s: float = 30.0):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = f"meshrl-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, **CREDENTIALS, "client_kwargs": {"region_name": "us-east-1"}}

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def __enter__(self) -> "MotoS3Server":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode} (is moto[server] installed?)")
            try:
                httpx.get(self.endpoint, timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"moto server on {self.endpoint} not up within {self.timeout_s:.0f}s")
                time.sleep(0.2)
        httpx.put(f"{self.endpoint}/{self.bucket}", timeout=10.0).raise_for_status()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
