"""Validation of a `/v1/chat/completions` request body, field by field: an agent program is
untrusted, so anything meshrl cannot serve exactly is refused with a `BadRequest` naming the field
(HTTP 400), never guessed at.

With `tools` (OpenAI function schemas) the family's tool list goes into the system prompt, the
reply's calls are parsed from the sampled text (meshrl.renderers.tools) and returned as
`tool_calls`; `tool` messages become the family's tool-result turns.

Sampling parameters that decide the distribution sampled from (`temperature`, `top_p`, `seed`) are
checked for type and range but not applied: the run's sampling (`generator.sampling`, greedy during
evaluation) governs every completion, since the policy is trained on its own distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from meshrl.renderers.tools import ToolCall, tool_name

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 64
# fields the official client may send that change nothing meshrl serves (None, or a no-op value)
_INERT = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
# message keys the official client echoes back with None when an agent appends a reply object
_MESSAGE_NONE_KEYS = ("refusal", "audio", "function_call", "tool_calls", "annotations", "name")
_MESSAGE_KEYS = {"system": ("role", "content"), "user": ("role", "content"),
                 "assistant": ("role", "content", "tool_calls"), "tool": ("role", "content", "tool_call_id")}


class BadRequest(ValueError):
    """A request meshrl refuses; ``param`` names the offending field, ``status`` the HTTP status."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class ChatRequest:
    """What meshrl serves of a validated request."""

    messages: list[dict]
    """The conversation, each message `{role, content}` with string content; an assistant message
    with calls also has `tool_calls` (`ToolCall`s), a tool message its `tool_call_id`."""
    max_tokens: int
    tools: list[dict] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    model: str = "policy"


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(None, f"the request body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(key, f"{key} must be a number, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(key, f"{key} must be within [{low:g}, {high:g}], got {value!r}")


def _integer(body: dict, key: str, low: int, high: int, why: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(key, f"{key} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(key, f"{key} must be within [{low}, {high}]{why}, got {value}")
    return value


def _content(message: dict, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}]", f"{where}.content[{j}] must be a text part "
                                 "({type: text, text: ...}); images, audio and files are not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}.content", f"{where}.content must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


def _messages(body: dict, max_messages: int) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list of messages")
    if len(messages) > max_messages:
        raise BadRequest("messages", f"messages holds {len(messages)} messages, more than the {max_messages} allowed")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(where, f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        allowed = _MESSAGE_KEYS[role]
        extra = sorted(k for k, v in m.items() if k not in allowed and not (k in _MESSAGE_NONE_KEYS and v is None))
        if extra:
            raise BadRequest(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported in a {role} message "
                             f"(it has {', '.join(allowed)})")
        message = {"role": role, "content": _content(m, where)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of the call it answers")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    """An assistant message's calls in OpenAI's shape: `{id, type: function, function: {name, arguments}}`,
    the arguments a JSON object in a string."""
    if not isinstance(calls, list):
        raise BadRequest(where, f"{where} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise BadRequest(f"{where}[{j}]", f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}[{j}].function.arguments", f"{where}[{j}].function.arguments must be a JSON object")
        out.append(ToolCall(fn["name"], arguments, c["id"]))
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise BadRequest("tools", f"tools must be a list of 1 to {MAX_TOOLS} function schemas")
    names = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise BadRequest(f"tools[{j}]", f"tools[{j}] must be an object (an OpenAI function schema)")
        try:
            names.append(tool_name(tool))
        except ValueError as e:
            raise BadRequest(f"tools[{j}]", f"tools[{j}]: {e}") from None
    if len(set(names)) < len(names):
        raise BadRequest("tools", "tools: two tools have the same name")
    return tools


def validate(body: dict, max_tokens_limit: int, max_messages: int = 256) -> ChatRequest:
    """A `ChatRequest` of ``body``, or `BadRequest` naming the first field meshrl cannot serve.
    ``max_tokens_limit`` is the run's `generator.sampling.max_new_tokens` (also the default)."""
    known = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
             "stop", "logprobs", "top_logprobs", "seed", "tools", "tool_choice", "frequency_penalty",
             "presence_penalty", "logit_bias", "response_format", *_INERT}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(unknown[0], f"{unknown[0]} is not a chat completion field this endpoint knows")
    model = body.get("model", "policy")
    if not isinstance(model, str):
        raise BadRequest("model", f"model must be a string, got {type(model).__name__}")
    tools = _tools(body)
    if body.get("tool_choice") not in (None, "auto"):
        raise BadRequest("tool_choice", "tool_choice must be auto: the model decides whether to call a tool "
                         "(constrained decoding is not served)")
    if body.get("stream"):
        raise BadRequest("stream", "stream must be false: streamed responses are not served")
    _integer(body, "n", 1, 1, " (one completion per request)")
    if body.get("stop") not in (None, [], ""):
        raise BadRequest("stop", "stop sequences are not supported: a completion ends at the model's end-of-turn token")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadRequest(key, f"{key} must be 0: the policy's own distribution is sampled")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias", "logit_bias is not supported: the policy's own distribution is sampled")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("response_format", "response_format must be text: constrained decoding is not served")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _integer(body, "seed", -(2 ** 63), 2 ** 63 - 1)
    limit = f" (generator.sampling.max_new_tokens = {max_tokens_limit})"
    max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_limit, limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, max_tokens_limit, limit)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs", f"logprobs must be true or false, got {logprobs!r}")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs: true")
    return ChatRequest(messages=_messages(body, max_messages), max_tokens=max_tokens or max_tokens_limit,
                       tools=tools, logprobs=bool(logprobs), top_logprobs=top, model=model)


def check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A rendered prompt with room for ``max_tokens`` more within the context (`model.max_model_len`)."""
    if prompt_tokens + max_tokens > max_model_len:
        raise BadRequest("messages", f"the messages render to {prompt_tokens} tokens; with max_tokens {max_tokens} "
                         f"that passes the context of {max_model_len} tokens (model.max_model_len)")
