"""The OpenAI wire format of what the agent endpoint answers: a `chat.completion` object (with
`logprobs` in OpenAI's shape when asked) and an error object."""

from __future__ import annotations

import json
import time
from typing import Sequence

from meshrl.engines import Completion
from meshrl.renderers.tools import ToolCall


def _token(tokenizer, token_id: int) -> dict:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def logprobs_content(tokenizer, completion: Completion, content: Sequence[int], top: int) -> list[dict]:
    """One entry per content token (the reply before its stop token): the token, its logprob under
    the distribution it was sampled from, and the ``top`` most likely tokens there."""
    out = []
    for i, token_id in enumerate(content):
        entry = {**_token(tokenizer, token_id), "logprob": completion.logprobs[i], "top_logprobs": []}
        if top and completion.topk is not None:
            ids, values = completion.topk
            entry["top_logprobs"] = [{**_token(tokenizer, t), "logprob": v} for t, v in zip(ids[i][:top], values[i][:top])]
        out.append(entry)
    return out


def completion_body(completion_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, version: int, logprobs: list[dict] | None,
                    tool_calls: Sequence[ToolCall] = ()) -> dict:
    """A `chat.completion` object; `system_fingerprint` names the policy version that sampled it. A
    reply with calls has `tool_calls` (its content null when it said nothing else) and finish reason
    `tool_calls`."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None,
                   "tool_calls": [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                  for c in tool_calls]}
    reason = "length" if finish_reason == "length" else "tool_calls" if tool_calls else "stop"
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": f"meshrl-policy-v{version}",
        "choices": [{"index": 0, "message": message, "finish_reason": reason,
                     "logprobs": None if logprobs is None else {"content": logprobs}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def error_body(message: str, param: str | None, status: int) -> dict:
    """OpenAI's error object (the official client raises it as the matching APIStatusError)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
