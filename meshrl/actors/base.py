"""Common base of meshrl's sync actors."""

from __future__ import annotations

import os

from monarch.actor import Actor, endpoint


class MeshrlActor(Actor):
    """A sync actor with an `info` endpoint; its reply also proves `__init__` has finished."""

    def describe(self) -> dict:
        """Extra fields for `info` (override)."""
        return {}

    @endpoint
    def info(self) -> dict:
        return {"pid": os.getpid(), **self.describe()}
