"""Supervised data from conversation files: tinker-cookbook's `FromConversationFileBuilder` format,
one JSON object per line with a `messages` list of `{role, content}`.

`read_conversations` checks every line and fails on the first bad one with one line naming the file
and the line (`data.jsonl:17: ...`). `supervised_datum` renders a conversation with the model's
renderer, token in and token out (`Renderer.build_supervised_example`: the chat template's tokens,
weight 1 on the assistant turns' content and end-of-turn token, 0 elsewhere), and makes it a
`cross_entropy` Datum (`weights`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from meshrl.types import Datum

ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation's messages may have (the renderers render each literally)."""


class ConversationFileError(ValueError):
    """A conversation file that cannot be used; the message is one line naming `file:line`."""


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def json_object(line: str, where: str, error: type[ValueError], what: str = "a JSON object") -> dict:
    """The JSON object on ``line``; ``error`` naming ``where`` (`file:line`) if it is not JSON or
    not an object (``what`` says what was expected)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected {what}, got a {_json_type(obj)}")
    return obj


def parse_conversation(line: str, where: str) -> list[dict]:
    """The messages of one line (``where`` is `file:line` for the error message)."""
    obj = json_object(line, where, ConversationFileError, "a JSON object with a `messages` list")
    if "messages" not in obj:
        raise ConversationFileError(f"{where}: no `messages` key (keys: {', '.join(sorted(obj)) or 'none'})")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        what = "an empty array" if isinstance(messages, list) else f"a {_json_type(messages)}"
        raise ConversationFileError(f"{where}: `messages` must be a non-empty array of messages, got {what}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationFileError(f"{where}: message {i} is a {_json_type(message)}, not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationFileError(f"{where}: message {i}: unknown role {json.dumps(role)} (expected one of "
                                        f"{', '.join(ROLES)})")
        content = message.get("content")
        if not isinstance(content, str):
            got = "missing" if "content" not in message else f"a {_json_type(content)}"
            raise ConversationFileError(f"{where}: message {i} ({role}): `content` must be a string, got {got}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ConversationFileError(f"{where}: no assistant message (nothing to train on)")
    return out


def text_lines(path: str | Path, error: type[ValueError]) -> Iterator[tuple[str, str]]:
    """(`file:line`, line) for every non-blank line of a UTF-8 text file; ``error`` (a one-line
    message) for a missing file or one that is not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{path}: no such file")
    try:
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{lineno}", line
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None


def read_conversations(path: str | Path) -> list[list[dict]]:
    """Every conversation of a JSONL file, in order (blank lines skipped); raises
    `ConversationFileError` for a missing or empty file and for the first bad line."""
    conversations = [parse_conversation(line, where) for where, line in text_lines(path, ConversationFileError)]
    if not conversations:
        raise ConversationFileError(f"{path}: no conversations in it")
    return conversations


def supervised_datum(renderer, messages: list[dict], max_length: int,
                     only_last_assistant: bool = False) -> Datum | None:
    """The `cross_entropy` Datum of one conversation, cut to ``max_length`` tokens: the renderer's
    tokens, `weights` 1 on the (last, with ``only_last_assistant``) assistant turns' content and
    end-of-turn token. None when no weighted token is left after the cut."""
    tokens, weights = renderer.build_supervised_example(messages, only_last_assistant=only_last_assistant)
    return weighted_datum(tokens, weights, max_length)


def weighted_datum(tokens: list[int], weights: list[float], max_length: int) -> Datum | None:
    """The `cross_entropy` Datum of ``tokens`` with loss ``weights`` per token, cut to ``max_length``
    tokens; None when no weighted token is left after the cut (token 0 is never predicted)."""
    tokens, weights = tokens[:max_length], weights[:max_length]
    if len(tokens) < 2 or not any(weights[1:]):
        return None
    return Datum.from_sequence(tokens, weights=weights)
