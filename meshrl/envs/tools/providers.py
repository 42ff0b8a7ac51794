"""Tool providers: where an environment's tools come from, and how one call runs under a deadline.

A provider lists its tools as OpenAI-format JSON schemas (`schemas`) and runs a call
(`call(name, arguments, timeout_s) -> str`); a call that raises becomes `ToolFailed`, one past its
deadline `ToolTimedOut` (both end up as a tool turn that says so), and a provider whose server is
gone raises `ToolServerError` (the episode fails, `recover` restarts the server).

`FunctionTools` runs Python callables: the schema comes from the signature (type hints -> JSON
types, parameters without a default are required) and the docstring (first paragraph -> the
tool's description, `name: text` lines under `Args:` -> the parameters' descriptions), or is given
explicitly.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import types
import typing
from typing import Any, Callable, Sequence

from meshrl.renderers.tools import tool_name

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object",
               tuple: "array"}


class ToolFailed(RuntimeError):
    """The tool ran and raised (or reported an error); the message says what happened."""


class ToolTimedOut(TimeoutError):
    """The tool gave no answer within its deadline."""


class ToolServerError(RuntimeError):
    """The tools' server is gone: the episode fails and the provider is recovered."""


def _json_type(hint: Any) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    base = origin or hint
    if base in _JSON_TYPES:
        schema = {"type": _JSON_TYPES[base]}
        args = typing.get_args(hint)
        if base is list and args:
            schema["items"] = _json_type(args[0])
        return schema
    return {}


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` (or `name (type): text`) lines of a docstring's `Args:` section."""
    out, inside = {}, False
    for line in doc.splitlines():
        if re.match(r"^\s*(Args|Arguments|Parameters):\s*$", line):
            inside = True
            continue
        if inside:
            m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                inside = False
    return out


def function_schema(fn: Callable) -> dict:
    """The OpenAI-format schema of a Python callable, from its signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    hints = typing.get_type_hints(fn)
    params, required, arg_docs = {}, [], _arg_docs(doc)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = _json_type(hints[name]) if name in hints else {}
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        params[name] = prop
        if p.default is p.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": fn.__name__, "description": description,
        "parameters": {"type": "object", "properties": params, "required": required}}}


def result_text(value: Any) -> str:
    """A tool's return value as the text of its tool turn (JSON for anything but a string)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` in a daemon thread; ToolTimedOut past ``timeout_s`` (the thread is abandoned),
    ToolFailed when it raises."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- whatever the tool raises is its failure
            box["error"] = e

    t = threading.Thread(target=run, name=f"tool-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ToolTimedOut(f"{what} gave no answer within {timeout_s:g}s")
    if "error" in box:
        e = box["error"]
        raise ToolFailed(f"{what} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    return box["value"]


class FunctionTools:
    """Python callables as tools, each with its schema (derived from the callable, or given)."""

    def __init__(self, functions: Sequence[Callable], schemas: dict[str, dict] | None = None):
        schemas = dict(schemas or {})
        self.functions: dict[str, Callable] = {}
        self._schemas: list[dict] = []
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
            schema = schemas.pop(fn.__name__, None) or function_schema(fn)
            name = tool_name(schema)
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}")
            self.functions[name] = fn
            self._schemas.append(schema)
        if schemas:
            raise ValueError(f"schemas given for tools that do not exist: {sorted(schemas)}")

    def schemas(self) -> list[dict]:
        return list(self._schemas)

    def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        fn = self.functions[name]
        return result_text(call_with_deadline(lambda: fn(**arguments), timeout_s, f"tool {name}"))

    def recover(self) -> bool:
        return False

    def close(self) -> None:
        pass
