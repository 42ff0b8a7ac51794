"""An episode's served completions and the trajectories assembled from them, token-in/token-out.

Every completion meshrl serves is recorded with the exact prompt tokens it rendered and the tokens
and logprobs it sampled (`ServedCall`). A request's messages are rendered with substitution
(`render_prompt`): an assistant message whose content equals a reply served earlier in the episode is
rendered from that reply's sampled tokens, not re-tokenised, so a conversation the agent carries on
renders to a prompt that extends the previous prompt and completion token for token.

`assemble` turns the calls into segments: a call whose prompt extends (token for token) a segment's
prompt and completions so far continues that segment (the tokens between are the environment's turn,
never trained); any other starts a new segment. Each segment becomes one Trajectory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from meshrl.renderers import Renderer


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


def render_prompt(renderer: Renderer, messages: Sequence[dict], served: Sequence[ServedCall]) -> list[int]:
    """The generation prompt of ``messages``, each assistant message whose content equals a reply
    in ``served`` (the latest such) rendered as the generation header, that reply's sampled content
    tokens, the stop token and the template's separator: what the policy saw and sampled."""
    by_text = {call.text: call for call in served}
    header = renderer.generation_header()
    tokens: list[int] = []
    for message, turn in renderer.render_turns(messages):
        call = by_text.get(message["content"]) if message.get("role") == "assistant" else None
        if call is None:
            tokens += turn.tokens
        else:
            tokens += header + reply_tokens(renderer, call.tokens) + turn.stop + turn.separator
    return tokens + header


class EpisodeLog:
    """The calls served to one episode, safe to record from the server's threads; ``closed`` once
    its program has ended (later requests are refused)."""

    def __init__(self, max_calls: int):
        self.max_calls = max_calls
        self.calls: list[ServedCall] = []
        self.requested = 0  # requests admitted (served or in flight)
        self.closed = False
        self._lock = threading.Lock()

    def admit(self) -> bool:
        """Count one more request; False when the episode is over or out of completions."""
        with self._lock:
            if self.closed or self.requested >= self.max_calls:
                return False
            self.requested += 1
            return True

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
