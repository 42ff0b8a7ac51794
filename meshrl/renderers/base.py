"""Renderer base class: messages <-> tokens, token-in/token-out.

A conversation is rendered turn by turn; each turn is four token runs
    header     role marker, never trained                      e.g. <|im_start|>assistant\n
    content    the message text                               trained for assistant turns
    stop       end-of-turn token the model itself emits       trained for assistant turns
    separator  what the template puts after the stop token    e.g. "\n" (never trained: the model
                                                              stops before it)
and the concatenation over turns (plus the generation header) equals, token for token, tokenising
the text that the model's own chat template produces.  Special tokens split text into independently
tokenised segments, so rendering each segment separately is exact; the text between two special
tokens is always tokenised in one piece, as the full-conversation tokenisation would.

Multi-turn rollouts never re-tokenise history: :meth:`Renderer.bridge` returns only the tokens to
append after the sampled assistant tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

Message = dict[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str}."""


@dataclass
class RenderedTurn:
    header: list[int]
    content: list[int]
    stop: list[int]
    separator: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.header + self.content + self.stop + self.separator


def message_text(message: Message) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        role = message.get("role")
        raise TypeError(f"message content must be a string, got {type(content).__name__} (role {role!r})")
    return content


class Renderer(ABC):
    """Converts chat messages to token ids and back for one chat format."""

    name: str = "abstract"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ helpers for subclasses
    def encode(self, text: str) -> list[int]:
        """Tokenise a text segment with no BOS/EOS added."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_split(self, header_text: str, body_text: str) -> tuple[list[int], list[int]]:
        """Tokenise ``header_text + body_text`` in one piece (as the template's text is) and split the
        tokens at the character boundary: tokens ending inside the header belong to the header, a
        token merged across the boundary belongs to the body (so it is trained with the body).
        """
        text = header_text + body_text
        if not text:
            return [], []
        if getattr(self.tokenizer, "is_fast", False):
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(encoded["input_ids"])
            n = sum(1 for _, end in encoded["offset_mapping"] if end <= len(header_text))
            return ids[:n], ids[n:]
        joint, header = self.encode(text), self.encode(header_text)  # slow tokenizer: common prefix
        n = 0
        while n < min(len(header), len(joint)) and header[n] == joint[n]:
            n += 1
        return joint[:n], joint[n:]

    def special_token_id(self, token: str) -> int:
        """Id of a special token that must exist as a single token in the vocabulary."""
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or self.tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"tokenizer has no special token {token!r}; the {self.name} renderer needs it")
        return int(token_id)

    # ------------------------------------------------------------------ format-specific pieces
    @abstractmethod
    def render_turn(self, message: Message, is_first: bool) -> RenderedTurn:
        """Tokens of one message; ``is_first`` marks the first rendered message of a conversation."""

    @abstractmethod
    def generation_header(self) -> list[int]:
        """Tokens that open an assistant turn (what add_generation_prompt appends)."""

    @abstractmethod
    def get_stop_sequences(self) -> list[int]:
        """Token ids on which sampling must stop (the end-of-turn token)."""

    def conversation_messages(self, messages: Sequence[Message]) -> list[Message]:
        """Messages as the template sees them (e.g. with a default system prompt inserted)."""
        return list(messages)

    # ------------------------------------------------------------------ public API
    def render_turns(self, messages: Sequence[Message]) -> list[tuple[Message, RenderedTurn]]:
        full = self.conversation_messages(messages)
        return [(m, self.render_turn(m, is_first=(i == 0))) for i, m in enumerate(full)]

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
        """The whole conversation as token ids (equals the chat template's tokenisation)."""
        tokens = [t for _, turn in self.render_turns(messages) for t in turn.tokens]
        if add_generation_prompt:
            tokens += self.generation_header()
        return tokens

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Prompt tokens for sampling the next assistant message."""
        return self.render(messages, add_generation_prompt=True)

    def build_supervised_example(
        self, messages: Sequence[Message], only_last_assistant: bool = False
    ) -> tuple[list[int], list[float]]:
        """(tokens, weights): weight 1 on assistant content and its stop token, 0 elsewhere."""
        turns = self.render_turns(messages)
        assistant_positions = [i for i, (m, _) in enumerate(turns) if m.get("role") == "assistant"]
        trained = set(assistant_positions[-1:] if only_last_assistant else assistant_positions)
        tokens: list[int] = []
        weights: list[float] = []
        for i, (_, turn) in enumerate(turns):
            w = 1.0 if i in trained else 0.0
            tokens += turn.tokens
            weights += [0.0] * len(turn.header) + [w] * (len(turn.content) + len(turn.stop))
            weights += [0.0] * len(turn.separator)
        return tokens, weights

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        """Decode sampled assistant tokens up to the first stop token.

        Returns (message, ok); ok is False when no stop token was sampled (e.g. max_tokens hit),
        in which case the message holds everything that was sampled.
        """
        tokens = list(tokens)
        stops = set(self.get_stop_sequences())
        end = next((i for i, t in enumerate(tokens) if t in stops), None)
        body = tokens if end is None else tokens[:end]
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        return {"role": "assistant", "content": text}, end is not None

    def bridge(
        self, prev_tokens: Sequence[int], new_messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Tokens to append after a finished assistant turn to add ``new_messages`` (tool/user turns).

        ``prev_tokens`` is the full token sequence so far, ending with the sampled assistant tokens.
        If sampling stopped on a stop token, only the template's separator is added before the new
        turns; if it was truncated, the turn is closed with the stop token first.  History is never
        re-tokenised, so prev_tokens + bridge(...) is exactly what the policy will be trained on.
        """
        if not prev_tokens:
            return self.render(new_messages, add_generation_prompt)
        stops = self.get_stop_sequences()
        closing = [] if prev_tokens[-1] in stops else [stops[0]]
        out = closing + self._separator_after_stop()
        for message in new_messages:
            out += self.render_turn(message, is_first=False).tokens
        if add_generation_prompt:
            out += self.generation_header()
        return out

    # ------------------------------------------------------------------ tool calling (meshrl.renderers.tools)
    def tools_system_text(self, tools: list[dict]) -> str:
        """The tool list (OpenAI function schemas) as this family puts it in the system prompt."""
        return self.tool_format.tools_system_text(tools)

    def parse_tool_calls(self, text: str):
        """(content without the calls, every call) of a sampled assistant turn's text; a malformed
        call raises ToolCallError (kind `wrong_format`)."""
        return self.tool_format.parse_tool_calls(text)

    def tool_result_message(self, call, content: str) -> Message:
        """The result of ``call`` as this family's tool turn."""
        return self.tool_format.tool_result_message(call, content)

    @property
    def tool_format(self):
        """This family's tool format (meshrl.renderers.tools)."""
        from meshrl.renderers.tools import tool_format

        return tool_format(self.name)

    def _separator_after_stop(self) -> list[int]:
        """Separator the template places after an assistant turn's stop token."""
        return self.render_turn({"role": "assistant", "content": ""}, is_first=False).separator
