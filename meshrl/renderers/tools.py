"""Tool calling in each chat family's own format: the tool list as the family puts it in the system
prompt, the calls parsed from a sampled assistant turn, and the tool results as the family's tool
turns. Pure text in, text out; the renderer appends the result turns token-in/token-out (`bridge`).

- `ChatMLTools` (Qwen2.5-style ChatML templates): the tools as JSON lines inside `<tools></tools>`
  in the system prompt; each call `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  the results of one turn's calls, each inside `<tool_response></tool_response>`, in ONE user turn
  (the template merges consecutive tool messages so).
- `Llama3Tools` (Llama 3.1 JSON tool calling): the tools as indented JSON in the system prompt;
  a call is the JSON object `{"name": ..., "parameters": {...}}` (several separated by `;` or new
  lines); each result is an `ipython` turn of its own, its text JSON-quoted as the template writes it.

Tools are JSON schemas in the OpenAI function format:
`{"type": "function", "function": {"name", "description", "parameters"}}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from meshrl.renderers.base import Message

TOOL_CALL_ERRORS = ("wrong_format", "tool_not_found")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments, and an id unique within the turn."""

    name: str
    arguments: dict
    id: str


class ToolCallError(ValueError):
    """A reply whose tool calls cannot be used; ``kind`` is its error site (`wrong_format` for a
    malformed call, `tool_not_found` for a call of a tool that does not exist)."""

    def __init__(self, kind: str, message: str):
        if kind not in TOOL_CALL_ERRORS:
            raise ValueError(f"tool call error kind must be one of {TOOL_CALL_ERRORS}, got {kind!r}")
        super().__init__(message)
        self.kind = kind


def tool_name(tool: dict) -> str:
    """The name of an OpenAI-format tool schema (ValueError when it is not one)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool must be {{type: function, function: {{name, description, parameters}}}}, got "
                         f"{json.dumps(tool)[:120]}")
    return fn["name"]


def _call(obj: Any, where: str, args_key: str, index: int) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallError("wrong_format", f"{where} is not a JSON object with a \"name\" string")
    arguments = obj.get(args_key, {})
    if isinstance(arguments, str):  # some models put the arguments in as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError("wrong_format", f"{where}: \"{args_key}\" is a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolCallError("wrong_format", f"{where}: \"{args_key}\" is not a JSON object")
    extra = set(obj) - {"name", args_key}
    if extra:
        raise ToolCallError("wrong_format", f"{where} has unexpected keys {sorted(extra)}")
    return ToolCall(obj["name"], arguments, f"call_{index}")


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError("wrong_format", f"{where} is not valid JSON ({e.msg} at character {e.pos})") from None


class ChatMLTools:
    """Qwen2.5's tool format for ChatML templates."""

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def tools_system_text(self, tools: Sequence[dict]) -> str:
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        for t in tools:
            tool_name(t)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" + lines +
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

    def system_with_tools(self, system: str, tools: Sequence[dict]) -> str:
        """The system prompt ``system`` with the tool list after it (as Qwen2.5's template writes it)."""
        return f"{system}\n\n{self.tools_system_text(tools)}"

    def parse_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [_call(_loads(m.group(1).strip(), f"tool call {i + 1}"), f"tool call {i + 1}", "arguments", i)
                 for i, m in enumerate(self.CALL.finditer(text))]
        content = self.CALL.sub("", text)
        if "<tool_call>" in content or "</tool_call>" in content:
            raise ToolCallError("wrong_format", "a <tool_call> tag is not closed (or a </tool_call> not opened)")
        return content.strip(), calls

    def tool_result_message(self, call: ToolCall, content: str) -> Message:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}

    def tool_results_messages(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """The turns that carry one assistant turn's results: one user turn with every response."""
        if not results:
            return []
        parts = [self.tool_result_message(c, r)["content"] for c, r in results]
        return [{"role": "user", "content": "\n".join(parts)}]


class Llama3Tools:
    """Llama 3.1's JSON tool calling (tools in the system prompt, results as `ipython` turns)."""

    def tools_system_text(self, tools: Sequence[dict]) -> str:
        for t in tools:
            tool_name(t)
        return ("You have access to the following functions. To call a function, please respond with JSON for a "
                "function call.Respond in the format {\"name\": function name, \"parameters\": dictionary of "
                "argument name and its value}.Do not use variables.\n\n"
                + "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)).rstrip("\n")

    def system_with_tools(self, system: str, tools: Sequence[dict]) -> str:
        """The system prompt ``system`` with the tool list before it (as Llama 3.1's template writes it)."""
        return f"{self.tools_system_text(tools)}\n\n{system}"

    def parse_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        if not body.startswith("{"):
            return text.strip(), []  # a reply, not a call
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                raise ToolCallError("wrong_format", f"tool call {len(calls) + 1} is not valid JSON "
                                                    f"({e.msg} at character {e.pos})") from None
            calls.append(_call(obj, f"tool call {len(calls) + 1}", "parameters", len(calls)))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return "", calls

    def tool_result_message(self, call: ToolCall, content: str) -> Message:
        # the template writes a result through `tojson` (a string is iterable in Jinja): quoted
        return {"role": "ipython", "content": json.dumps(content, ensure_ascii=False)}

    def tool_results_messages(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One `ipython` turn per result."""
        return [self.tool_result_message(c, r) for c, r in results]


TOOL_FORMATS = {"chatml": ChatMLTools, "llama3": Llama3Tools}
"""Tool formats by renderer name (what `task.env.tools.format` names)."""


def tool_format(name: str):
    """The tool format of renderer ``name``."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"no tool format {name!r}; choose one of {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]()
