"""Chat renderers (messages <-> token ids) and template-generic assistant masks.

    get_renderer("chatml" | "llama3", tokenizer)    explicit choice
    renderer_for_tokenizer(tokenizer)               picks by the tokenizer's chat template and checks
                                                    that the renderer reproduces it on a probe chat
"""

from __future__ import annotations

from meshrl.renderers.base import Message, RenderedTurn, Renderer
from meshrl.renderers.chatml import IM_END, IM_START, ChatMLRenderer
from meshrl.renderers.llama3 import START_HEADER, Llama3Renderer
from meshrl.renderers.masks import assistant_token_mask

RENDERERS = {"chatml": ChatMLRenderer, "llama3": Llama3Renderer}

_PROBE_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


def _chat_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ValueError("tokenizer has no chat template; pass a renderer name to get_renderer")
    return template


def template_default_system_prompt(tokenizer) -> str | None:
    """The system prompt a ChatML template inserts when the chat has none (SmolLM2 does), or None."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "probe"}], tokenize=False)
    head = f"{IM_START}system\n"
    if text.startswith(head) and IM_END in text:
        return text[len(head): text.index(IM_END)]
    return None


def get_renderer(name: str, tokenizer, **kwargs) -> Renderer:
    """Renderer ``name`` for ``tokenizer``.

    For "chatml", ``default_system_prompt`` defaults to the one the tokenizer's own template inserts
    (read by rendering a probe chat), so the output matches ``apply_chat_template``.
    """
    if name not in RENDERERS:
        raise ValueError(f"unknown renderer {name!r}; choose one of {sorted(RENDERERS)}")
    if name == "chatml" and "default_system_prompt" not in kwargs:
        try:
            has_chatml_template = IM_START in _chat_template(tokenizer)
        except ValueError:
            has_chatml_template = False
        kwargs["default_system_prompt"] = template_default_system_prompt(tokenizer) if has_chatml_template else None
    return RENDERERS[name](tokenizer, **kwargs)


def renderer_for_tokenizer(tokenizer) -> Renderer:
    """Pick the renderer matching the tokenizer's chat template; raise if it does not reproduce it."""
    template = _chat_template(tokenizer)
    if IM_START in template:
        renderer = get_renderer("chatml", tokenizer)
    elif START_HEADER in template:
        renderer = get_renderer("llama3", tokenizer)
    else:
        raise ValueError("chat template is neither ChatML nor Llama-3; no renderer available")
    for chat in _PROBE_CONVERSATIONS:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if renderer.build_generation_prompt(chat) != list(tokenizer.encode(text, add_special_tokens=False)):
            raise ValueError(f"the {renderer.name} renderer does not reproduce this tokenizer's chat template")
    return renderer


__all__ = [
    "ChatMLRenderer",
    "Llama3Renderer",
    "Message",
    "RENDERERS",
    "RenderedTurn",
    "Renderer",
    "assistant_token_mask",
    "get_renderer",
    "renderer_for_tokenizer",
    "template_default_system_prompt",
]
