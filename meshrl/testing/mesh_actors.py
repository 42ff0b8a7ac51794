"""Test-only actors for mesh management tests, in the package so actor processes can import them."""

from __future__ import annotations

import os
import time

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor


class Sleeper(MeshrlActor):
    """An actor that can be made to hang: ``sleep`` blocks its only thread."""

    @endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class EnvProbe(MeshrlActor):
    """Reports its process's environment, e.g. what a proc mesh's bootstrap set there."""

    @endpoint
    def getenv(self, key: str) -> str | None:
        return os.environ.get(key)


class FailsInInit(MeshrlActor):
    """An actor whose setup fails (its mesh never becomes ready)."""

    def __init__(self):
        raise RuntimeError("this actor cannot start")
