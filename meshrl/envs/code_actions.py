"""Reading the policy's reply in the code environment: the tools it may call (``TOOLS``), the
action type (``CodeAction``), and ``parse_action``, which finds the code to run -- a tool call
(``<tool_call>`` tags, a JSON block or bare JSON) first, else the last ```python block."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from meshrl.envs.base import TextAction

TOOLS = ("run_python", "submit")


class CodeAction(TextAction):
    """The policy's reply for one turn (``text``), as generated."""


# ----------------------------------------------------------------------------- code extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
_PY_LANGS = {"python", "py", "python3", "py3"}


@dataclass
class ParsedAction:
    tool: str | None
    """run_python, submit, or None for a plain fenced block."""
    code: str | None
    error_kind: str | None = None
    error: str = ""


def _json_objects(text: str) -> list[dict]:
    """JSON objects embedded in ``text`` (first-level braces, scanned left to right)."""
    found = []
    dec = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        i = text.find("{", end)
    return found


def _tool_call(text: str) -> dict | None:
    candidates: list[dict] = []
    for body in _TOOL_TAG.findall(text):
        candidates += _json_objects(body)
    if not candidates:
        for m in _FENCE.finditer(text):
            if m.group(1).lower() in ("json", "tool_call", ""):
                candidates += _json_objects(m.group(2))
    if not candidates:
        stripped = text.strip()
        if stripped.startswith("{"):
            candidates += _json_objects(stripped)
    for obj in candidates:
        if "function" in obj and isinstance(obj["function"], dict):  # OpenAI tool_calls shape
            obj = obj["function"]
        if "name" in obj and ("arguments" in obj or "parameters" in obj):
            return obj
    return None


def parse_action(text: str) -> ParsedAction:
    """Find the code in a reply: a tool call first, else the last ```python block (else the last
    untagged block)."""
    call = _tool_call(text or "")
    if call is not None:
        name = str(call.get("name"))
        args = call.get("arguments", call.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"code": args}
        if name not in TOOLS:
            return ParsedAction(name, None, "tool_not_found", f"unknown tool '{name}'; available: {', '.join(TOOLS)}")
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ParsedAction(name, None, "wrong_format", f"the {name} call has no 'code' argument")
        return ParsedAction(name, code)
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text or "")]
    py = [b for lang, b in blocks if lang in _PY_LANGS]
    plain = [b for lang, b in blocks if lang == ""]
    chosen = py[-1] if py else (plain[-1] if plain else None)
    if chosen is None or not chosen.strip():
        return ParsedAction(None, None, "wrong_format", "no ```python code block found")
    return ParsedAction(None, chosen)


def _as_action(action: Any) -> TextAction:
    if isinstance(action, TextAction):
        return action
    if isinstance(action, str):
        return CodeAction(text=action)
    if isinstance(action, dict):
        return CodeAction.model_validate(action)
    raise TypeError(f"CodeEnv.step takes a CodeAction, str or dict, got {type(action).__name__}")
