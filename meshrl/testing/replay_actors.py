"""Test-only actors for delayed results and the replay pool, in the package so actor processes can import
them."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from monarch.actor import Actor, Port, current_rank, endpoint

from meshrl.actors.teacher_replay import TeacherReplayActor
from meshrl.transport.delayed import DelayedOutbox
from meshrl.config.replay import ReplayPoolConfig, TeacherPanelConfig


class EchoProducer(Actor):
    """A producer whose "work" is to send its payload back after a delay."""

    def __init__(self, name: str):
        self.outbox = DelayedOutbox(f"{name}/{current_rank().rank}")
        self.tasks: set[asyncio.Task] = set()

    @endpoint
    async def subscribe(self, port: Port) -> int:
        return self.outbox.subscribe(port)

    @endpoint
    async def submit(
        self, key: str, episode_id: str, policy_version: int, payload: Any = None, delay_s: float = 0.0
    ) -> None:
        """Send at once (in call order) if ``delay_s`` is 0, else from a background task later."""
        if delay_s <= 0:
            self.outbox.send(key, payload, episode_id=episode_id, step=0, policy_version=policy_version)
            return

        async def later() -> None:
            await asyncio.sleep(delay_s)
            self.outbox.send(key, payload, episode_id=episode_id, step=0, policy_version=policy_version)

        task = asyncio.create_task(later())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @endpoint
    async def ack(self, keys: list[str]) -> int:
        return self.outbox.ack(keys)

    @endpoint
    async def stats(self) -> dict:
        return {"producer": self.outbox.producer, "pid": os.getpid(), **self.outbox.stats()}

    async def _handle_undeliverable_message(self, message: object) -> bool:
        self.outbox.count_undeliverable()
        return True


class LoggedTeacherReplayActor(TeacherReplayActor):
    """A teacher replay actor whose process writes stdout, stderr and DEBUG-level logs of every
    logger to ``log_path``, so a test can search everything it printed."""

    def __init__(
        self, log_path: str, replay_cfg: TeacherPanelConfig, pool_cfg: ReplayPoolConfig, name: str = "teacher_replay"
    ):
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        logging.basicConfig(level=logging.DEBUG, force=True)
        super().__init__(replay_cfg, pool_cfg, name)
