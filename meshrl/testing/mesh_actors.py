"""Test-only actors for mesh management tests, in the package so actor processes can import them."""

from __future__ import annotations

import os
import time

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.actors.learner import Learner


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


def _no_reference():
    raise RuntimeError("the learner was asked for its frozen reference model")


class LearnerWithoutReference(Learner):
    """The standard learner, except that a pass asking for the frozen reference model fails (so
    the run fails): a run whose DPO pairs carry precomputed reference log-probabilities never
    asks, and never loads a frozen copy of the model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainer.reference_model = _no_reference
