"""`launch.launcher: local`: every host mesh is this machine (Monarch's LocalJob)."""

from __future__ import annotations

from meshrl.launch.base import Launcher


class LocalLauncher(Launcher):
    """All meshes on this host, placed as `meshes.*` says."""

    kind = "local"

    def job(self):
        from monarch.job import LocalJob

        return LocalJob(hosts=tuple(self.cfg.hosts))
