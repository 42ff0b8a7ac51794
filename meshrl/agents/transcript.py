"""An episode's served completions and the trajectories assembled from them, token-in/token-out.

Every completion meshrl serves is recorded with the exact prompt tokens it rendered and the tokens
and logprobs it sampled (`ServedCall`). A request's messages are rendered with substitution
(`render_prompt`): an assistant message whose content equals a reply served earlier in the episode is
rendered from that reply's sampled tokens, not re-tokenised, so a conversation the agent carries on
renders to a prompt that extends the previous prompt and completion token for token.

With `tools` the family's tool list is added to the system prompt (the first system message, or
the template's default one), an assistant message with `tool_calls` must be a reply served earlier
(it is replayed from its tokens), and each run of `tool` messages becomes the family's tool-result
turns (`tool_results_messages`), every result matched to the served call its `tool_call_id` names.

`assemble` turns the calls into segments: a call whose prompt extends (token for token) a segment's
prompt and completions so far continues that segment (the tokens between are the environment's turn,
never trained); any other starts a new segment. Each segment becomes one Trajectory.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Sequence

from meshrl.agents.requests import BadRequest
from meshrl.renderers import Renderer
from meshrl.renderers.tools import ToolCall


@dataclass(frozen=True)
class ServedCall:
    """One completion served to an episode's agent."""

    messages: list[dict[str, str]]
    """The request's messages, as validated."""
    prompt: list[int]
    """The prompt tokens rendered (with substitution) and sampled from."""
    tokens: list[int]
    """The sampled tokens, with the stop token when the model stopped on one."""
    logprobs: list[float]
    text: str
    """The reply's content as served: the sampled tokens before the stop token, decoded."""
    finish_reason: str
    version: int
    """The policy version of the generator that sampled it."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls parsed from the reply (with `tools`), with the ids they were served under."""

    @property
    def reply(self) -> tuple:
        """What an assistant message echoing this reply carries (`reply_key`)."""
        return reply_key(self.text, self.tool_calls)


def reply_key(content: str, tool_calls: Sequence[ToolCall] = ()) -> tuple:
    """An assistant reply's identity: its content and its calls (arguments compared as JSON)."""
    return content, tuple((c.id, c.name, json.dumps(c.arguments, sort_keys=True)) for c in tool_calls)


@dataclass
class Segment:
    """A token sequence assembled from calls whose prompts extend one another."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple] = field(default_factory=list)  # (messages, reply text, start, end) per call
    version: int = 1 << 30  # the oldest version that sampled any of its calls
    finish_reason: str = ""  # its last call's

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    def add(self, call: ServedCall) -> None:
        """Append ``call``, whose prompt extends this segment's sequence."""
        between = call.prompt[len(self.prompt) + len(self.tokens):]
        self.tokens += between
        self.logprobs += [0.0] * len(between)
        self.mask += [0] * len(between)
        start = len(self.tokens)
        self.tokens += call.tokens
        self.logprobs += call.logprobs
        self.mask += [1] * len(call.tokens)
        self.turns.append((call.messages, call.text, start, len(self.tokens)))
        self.version = min(self.version, call.version)
        self.finish_reason = call.finish_reason


def plain(messages: Sequence[dict]) -> list[dict]:
    """Validated messages as JSON data (each `ToolCall` as `{id, name, arguments}`), for records."""
    return [{**m, "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m["tool_calls"]]}
            if "tool_calls" in m else dict(m) for m in messages]


def extends(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether ``prompt`` starts with ``prefix`` token for token and goes on past it."""
    return len(prompt) > len(prefix) and list(prompt[:len(prefix)]) == list(prefix)


def assemble(calls: Sequence[ServedCall]) -> list[Segment]:
    """The segments of an episode's calls, in the order they were served: a call continues the
    latest segment whose sequence its prompt extends, else it opens a new one."""
    segments: list[Segment] = []
    for call in calls:
        home = next((s for s in reversed(segments) if extends(call.prompt, s.sequence)), None)
        if home is None:
            home = Segment(prompt=list(call.prompt))
            segments.append(home)
        home.add(call)
    return segments


def reply_tokens(renderer: Renderer, tokens: Sequence[int]) -> list[int]:
    """The content tokens of a sampled reply: everything before its first stop token."""
    stops = set(renderer.get_stop_sequences())
    end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return list(tokens[:end])


def render_prompt(renderer: Renderer, messages: Sequence[dict], served: Sequence[ServedCall],
                  tools: list[dict] | None = None) -> list[int]:
    """The generation prompt of ``messages`` (with ``tools`` in the system prompt), each assistant
    message that equals a reply in ``served`` (the latest such) rendered as the generation header,
    that reply's sampled content tokens, the stop token and the template's separator: what the
    policy saw and sampled. BadRequest for a message that cannot be rendered exactly."""
    replies = {call.reply: call for call in served}
    conversation, replayed = _conversation(renderer, messages, served, tools)
    header = renderer.generation_header()
    tokens: list[int] = []
    for message, turn in renderer.render_turns(conversation):
        call = replies.get(replayed.get(id(message)))
        if call is None:
            tokens += turn.tokens
        else:
            tokens += header + reply_tokens(renderer, call.tokens) + turn.stop + turn.separator
    return tokens + header


def _conversation(renderer: Renderer, messages: Sequence[dict], served: Sequence[ServedCall],
                  tools: list[dict] | None) -> tuple[list[dict], dict[int, tuple]]:
    """The messages as the renderer renders them (tool list in the system prompt, tool results as the
    family's turns) and, by message identity, the reply key of each assistant message."""
    fmt = renderer.tool_format if tools or any(m["role"] == "tool" for m in messages) else None
    served_calls = {c.id: c for call in served for c in call.tool_calls}
    replies = {call.reply for call in served}
    out: list[dict] = []
    replayed: dict[int, tuple] = {}
    pending: list[tuple[ToolCall, str]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            call = served_calls.get(m["tool_call_id"])
            if call is None:
                raise BadRequest(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id {m['tool_call_id']!r} "
                                 "names no tool call served to this episode")
            pending.append((call, m["content"]))
            continue
        out += fmt.tool_results_messages(pending) if pending else []
        pending = []
        message = {"role": m["role"], "content": m["content"]}
        if m["role"] == "assistant":
            key = reply_key(m["content"], m.get("tool_calls", ()))
            if m.get("tool_calls") and key not in replies:
                raise BadRequest(f"messages[{i}].tool_calls", f"messages[{i}]: an assistant message with tool_calls "
                                 "must be a reply this endpoint served to the episode, unchanged")
            replayed[id(message)] = key
        out.append(message)
    out += fmt.tool_results_messages(pending) if pending else []
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": fmt.system_with_tools(out[0]["content"], tools)}
        else:
            default = getattr(renderer, "default_system_prompt", None)
            text = fmt.system_with_tools(default, tools) if default else fmt.tools_system_text(tools)
            out.insert(0, {"role": "system", "content": text})
    return out, replayed


class EpisodeLog:
    """The calls served to one episode, safe to record from the server's threads; ``closed`` once
    its program has ended (later requests are refused)."""

    def __init__(self, max_calls: int):
        self.max_calls = max_calls
        self.calls: list[ServedCall] = []
        self.requested = 0  # requests admitted (served or in flight)
        self.closed = False
        self._lock = threading.Lock()

    def admit(self) -> int | None:
        """Count one more request: its index in the episode; None when the episode is over or out of
        completions."""
        with self._lock:
            if self.closed or self.requested >= self.max_calls:
                return None
            self.requested += 1
            return self.requested - 1

    def served(self) -> list[ServedCall]:
        with self._lock:
            return list(self.calls)

    def record(self, call: ServedCall) -> bool:
        """Keep ``call``; False (and not kept) when the episode closed while it was sampled."""
        with self._lock:
            if self.closed:
                return False
            self.calls.append(call)
            return True

    def close(self) -> list[ServedCall]:
        """No more requests or records; the calls served."""
        with self._lock:
            self.closed = True
            return list(self.calls)
