"""Llama-3 (Meta-Llama-3-*-Instruct) renderer.

Template text per message (content is whitespace-trimmed, as the official template's ``| trim``):
    <|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>
with <|begin_of_text|> (the BOS token) before the first message; generation prompt:
    <|start_header_id|>assistant<|end_header_id|>\n\n
The Llama-3.1+ templates (date/tool system preamble) are not reproduced.
"""

from __future__ import annotations

from meshrl.renderers.base import Message, RenderedTurn, Renderer, message_text

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"


class Llama3Renderer(Renderer):
    name = "llama3"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.bos = self.special_token_id(BEGIN_OF_TEXT)
        self.start_header = self.special_token_id(START_HEADER)
        self.end_header = self.special_token_id(END_HEADER)
        self.eot = self.special_token_id(EOT)

    def _role_header(self, role: str) -> list[int]:
        return [self.start_header] + self.encode(role) + [self.end_header]

    def render_turn(self, message: Message, is_first: bool) -> RenderedTurn:
        blank, content = self.encode_split("\n\n", message_text(message).strip())
        header = ([self.bos] if is_first else []) + self._role_header(message["role"]) + blank
        return RenderedTurn(header, content, [self.eot], [])

    def generation_header(self) -> list[int]:
        return self._role_header("assistant") + self.encode("\n\n")

    def get_stop_sequences(self) -> list[int]:
        return [self.eot]
