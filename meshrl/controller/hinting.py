"""The optional LLM hint generator for channel 2, called from the synchronous controller: one
short-lived async client per batch, every request bounded by the endpoint timeout and the batch by
an overall deadline; a failed or missing hint falls back to the templates (and is counted)."""

from __future__ import annotations

import asyncio

from meshrl.teachers.config import HintGeneratorConfig


def llm_hint_source(cfg: HintGeneratorConfig, renderer, deadline_s: float):
    """A `hint_source` for `select_error_sites` that asks the configured model for each hint."""
    from meshrl.teachers.client import TeacherClient
    from meshrl.teachers.hints import LLMHintGenerator

    counts: dict[str, int] = {}

    def source(trajectories: list, kinds: list[str]) -> list[str | None]:
        async def ask() -> list[str | None]:
            client = TeacherClient(cfg.endpoint)
            generator = LLMHintGenerator(client, cfg)
            try:
                requests = []
                for t, kind in zip(trajectories, kinds):
                    context = renderer.conversation_messages(list(getattr(t.problem, "messages", ()) or ()))
                    if t.info.get("turns"):
                        context = list(t.info["turns"][-1][0])
                    error = t.info.get("error_text") or f"reply: {t.response_text!r}"
                    requests.append(generator.hint(context, kind, str(error)))
                return await asyncio.wait_for(asyncio.gather(*requests), deadline_s)
            finally:
                for kind, n in generator.counts.items():
                    counts[kind] = counts.get(kind, 0) + n
                await client.aclose()

        try:
            return asyncio.run(ask())
        except asyncio.TimeoutError:
            counts["deadline"] = counts.get("deadline", 0) + 1
            return [None] * len(trajectories)

    source.counts = counts
    return source
