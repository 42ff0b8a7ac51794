"""ChatML (SmolLM2, Qwen-style) renderer.

Template text per message:   <|im_start|>{role}\n{content}<|im_end|>\n
generation prompt:           <|im_start|>assistant\n
SmolLM2's template inserts   <|im_start|>system\n{default}<|im_end|>\n   before the first message
when that message is not a system message; pass ``default_system_prompt`` (or let
:func:`meshrl.renderers.get_renderer` read it from the tokenizer's template) to match it.
Roles are rendered literally (SmolLM2 renders tool results as ``<|im_start|>tool``); Qwen's
<tool_call>/<tool_response> wrapping is not reproduced.
"""

from __future__ import annotations

from typing import Sequence

from meshrl.renderers.base import Message, RenderedTurn, Renderer, message_text

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class ChatMLRenderer(Renderer):
    name = "chatml"

    def __init__(self, tokenizer, default_system_prompt: str | None = None) -> None:
        super().__init__(tokenizer)
        self.default_system_prompt = default_system_prompt
        self.im_start = self.special_token_id(IM_START)
        self.im_end = self.special_token_id(IM_END)
        self.newline = self.encode("\n")

    def conversation_messages(self, messages: Sequence[Message]) -> list[Message]:
        messages = list(messages)
        if self.default_system_prompt is not None and messages and messages[0].get("role") != "system":
            return [{"role": "system", "content": self.default_system_prompt}] + messages
        return messages

    def render_turn(self, message: Message, is_first: bool) -> RenderedTurn:
        # role line and content sit between the same two special tokens: tokenised together
        header, content = self.encode_split(f"{message['role']}\n", message_text(message))
        return RenderedTurn([self.im_start] + header, content, [self.im_end], list(self.newline))

    def generation_header(self) -> list[int]:
        return [self.im_start] + self.encode("assistant\n")

    def get_stop_sequences(self) -> list[int]:
        return [self.im_end]
