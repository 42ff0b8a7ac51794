"""Optional LLM hint generator for the SDPO channel: given the context the student saw and a
description of its error, ask a model (through the same client as the teachers) for a short hint.

`llm_hint_source` wraps it for the synchronous controller: one short-lived async client per batch,
every request bounded by the endpoint timeout and the batch by an overall deadline; a failed or
missing hint falls back to the templates (and is counted).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from meshrl.teachers.client import TeacherClient, TeacherError
from meshrl.config.sdpo import HintGeneratorConfig

log = logging.getLogger(__name__)


def render_transcript(messages: list[dict[str, Any]], max_chars: int) -> str:
    """The conversation as ``role: content`` blocks, cut to its last ``max_chars`` characters."""
    text = "\n\n".join(f"{m.get('role', '?')}: {m.get('content') or ''}" for m in messages)
    return text if len(text) <= max_chars else "..." + text[-max_chars:]


class LLMHintGenerator:
    """``await gen.hint(context, error_kind, error_text)`` returns a short hint or None.

    ``counts`` holds ``ok``, ``empty`` (the model replied with nothing) and one entry per teacher
    error kind."""

    def __init__(self, client: TeacherClient, cfg: HintGeneratorConfig):
        self.client = client
        self.cfg = cfg
        self.counts: Counter[str] = Counter()

    def prompt(self, context_messages: list[dict[str, Any]], error_kind: str, error_text: str) -> list[dict[str, str]]:
        """The chat messages sent to the hint model."""
        cfg = self.cfg
        user = (
            "Conversation the student saw:\n\n"
            f"{render_transcript(context_messages, cfg.max_context_chars)}\n\n"
            f"The student's last action failed ({error_kind}):\n{error_text[: cfg.max_error_chars]}\n\n"
            "Hint:"
        )
        return [{"role": "system", "content": cfg.instruction}, {"role": "user", "content": user}]

    async def hint(self, context_messages: list[dict[str, Any]], error_kind: str, error_text: str) -> str | None:
        try:
            reply = await self.client.chat(self.prompt(context_messages, error_kind, error_text))
        except TeacherError as e:
            self.counts[e.kind] += 1
            return None
        text = reply.text.strip()
        if not text:
            self.counts["empty"] += 1
            return None
        self.counts["ok"] += 1
        return text[: self.cfg.max_hint_chars]


def llm_hint_source(cfg: HintGeneratorConfig, renderer, deadline_s: float):
    """A `hint_source` for `select_error_sites` that asks the configured model for each hint."""
    counts: dict[str, int] = {}

    def source(turns: list) -> list[str | None]:
        async def ask() -> list[str | None]:
            client = TeacherClient(cfg.endpoint)
            generator = LLMHintGenerator(client, cfg)
            try:
                requests = []
                for turn in turns:
                    t = turn.trajectory
                    context = turn.context or renderer.conversation_messages(
                        list(getattr(t.problem, "messages", ()) or ()))
                    error = turn.error_text or f"reply: {t.response_text!r}"
                    requests.append(generator.hint(context, turn.kind, str(error)))
                return await asyncio.wait_for(asyncio.gather(*requests), deadline_s)
            finally:
                for kind, n in generator.counts.items():
                    counts[kind] = counts.get(kind, 0) + n
                await client.aclose()

        try:
            return asyncio.run(ask())
        except asyncio.TimeoutError:
            counts["deadline"] = counts.get("deadline", 0) + 1
            return [None] * len(turns)

    source.counts = counts
    return source
