"""The judge's prompt and the reading of its reply: pure functions.

The policy writes the transcript and the answer, so it controls part of the judge's prompt and will
try to steer it: a "Score: 10" line in its answer, a fake rubric, a closing ``</answer>`` followed
by instructions. The defences here:

- every line of the policy's (and the environment's) text is quoted with ``"| "``, so none of it
  can stand at the start of a line of the prompt, and a judge that echoes it cannot produce a
  ``Score:`` line from it (the score is read only from lines that start with ``Score``);
- tag look-alikes of the prompt's delimiters (``<answer>``, ``</ transcript >``, ``<TASK x>``,
  ``＜/answer＞`` ...) in that text are defused (their angle brackets become ``‹ ›``), after the
  invisible format characters (zero-width spaces and joiners, ...) that could hide a tag are removed;
- the transcript and the answer are cut to a maximum length (the middle is dropped and marked);
- the score comes only from the judge's reply: its last ``Score:`` line, or a strict JSON object.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

QUOTE = "| "
"""Prefix of every line of quoted (policy or environment) text in the prompt."""

DELIMITER_TAGS = ("task", "transcript", "answer", "turn", "rubric", "score", "system", "user", "assistant")
"""Tag names whose look-alikes are defused in quoted text (the default rubric's delimiters and the
names a forged rubric would use)."""

_OPEN, _CLOSE = "<＜﹤〈⟨", ">＞﹥〉⟩"
"""Angle brackets and their look-alikes."""
_TAG = re.compile(r"[%s](\s*/?\s*(?:%s)\b[^%s%s]{0,200})([%s]?)" % (_OPEN, "|".join(DELIMITER_TAGS), _OPEN, _CLOSE, _CLOSE),
                  re.IGNORECASE)

_SCORE_LINE = re.compile(r"^[\s*_#>`]*score[\s*_`]*[:=][\s*_`]*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)",
                         re.IGNORECASE)
"""A line that starts (after markdown emphasis) with ``Score:`` or ``Score =`` and a number. The
quote prefix ``| `` is not in the allowed lead, so a quoted line never matches."""

_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL | re.IGNORECASE)


def defuse(text: str) -> tuple[str, int]:
    """``text`` without format characters and with the angle brackets of delimiter look-alikes
    replaced (``<answer>`` becomes ``‹answer›``), and how many tags were defused."""
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return _TAG.subn(lambda m: f"‹{m.group(1)}{'›' if m.group(2) else ''}", text)


def quote(text: str) -> str:
    """Every line of ``text`` prefixed with ``QUOTE`` (an empty text is one quoted empty line).
    Lines are split as the score parser splits them (``str.splitlines``: ``\\r``, ``\\x0b``,
    ``\\u2028`` ... too), so no line break can leave part of the text unquoted."""
    return "\n".join(QUOTE + line for line in text.splitlines() or [""])


def cut_middle(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to about ``limit`` characters by dropping its middle (marked), and whether it was cut."""
    if len(text) <= limit:
        return text, False
    marker = f"\n[... {len(text) - limit} characters cut ...]\n"
    head = max(0, (limit - len(marker)) // 2)
    tail = max(0, limit - len(marker) - head)
    return text[:head] + marker + (text[-tail:] if tail else ""), True


@dataclass(frozen=True)
class Prompt:
    """The judge's messages, and what building them did to the policy's text."""

    messages: list[dict[str, str]]
    truncated: int
    """How many of the transcript and the answer were cut."""
    defused: int
    """How many delimiter look-alikes were defused."""


def _message_text(message: dict[str, Any]) -> str:
    """A message's text: its string content, the text parts of a list content (OpenAI's content
    parts), and its tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls")
    if calls:
        text += ("\n" if text else "") + "tool calls: " + json.dumps(calls, ensure_ascii=False, default=str)
    return text


def render_transcript(messages: list[dict[str, Any]]) -> str:
    """A transcript as role headers and message texts (not yet quoted)."""
    return "\n\n".join(f"[{m.get('role', '?')}]\n{_message_text(m)}" for m in messages)


def build_prompt(rubric: str, system: str, task: str, transcript: list[dict[str, Any]], answer: str,
                 max_chars: int) -> Prompt:
    """The judge's messages: the rubric with the task, the transcript and the answer filled in,
    each cut to ``max_chars``, defused and quoted line by line."""
    truncated = defused = 0
    fields = {}
    for name, text in (("task", task), ("transcript", render_transcript(transcript)), ("answer", answer)):
        text, cut = cut_middle(text, max_chars)
        text, n = defuse(text)
        truncated, defused = truncated + cut, defused + n
        fields[name] = quote(text)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": rubric.format(**fields)})
    return Prompt(messages, truncated, defused)


class MalformedReply(ValueError):
    """A judge reply with no usable score; the message says why in one line."""


def parse_score(reply: str, score_format: str, json_field: str) -> float:
    """The raw score in ``reply``: its last ``Score:`` line (``line``), or the number under
    ``json_field`` of the JSON object that is the whole reply (``json``, a ```json fence allowed).
    MalformedReply when there is none or it is not finite."""
    if score_format == "json":
        body = reply.strip()
        fenced = _FENCE.match(body)
        try:
            data = json.loads(fenced.group(1) if fenced else body)
        except json.JSONDecodeError:
            raise MalformedReply("the reply is not a JSON object") from None
        if not isinstance(data, dict) or json_field not in data:
            raise MalformedReply(f"the reply's JSON has no field {json_field!r}")
        value = data[json_field]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MalformedReply(f"the reply's {json_field!r} is {type(value).__name__}, not a number")
        score = float(value)
    else:
        found = [m.group(1) for line in reply.splitlines() if (m := _SCORE_LINE.match(line))]
        if not found:
            raise MalformedReply("no 'Score: N' line in the reply")
        score = float(found[-1])
    if not math.isfinite(score):
        raise MalformedReply(f"the score {score!r} is not finite")
    return score


def normalise(score: float, low: float, high: float) -> float:
    """``score`` on [low, high] mapped to [0, 1]; MalformedReply when it is outside the scale."""
    if not low <= score <= high:
        raise MalformedReply(f"the score {score:g} is outside the scale [{low:g}, {high:g}]")
    return (score - low) / (high - low)


def mix(verifier: float, judge: float, weight: float) -> float:
    """The reward of a judged episode: ``(1 - weight) * verifier + weight * judge``."""
    return (1.0 - weight) * verifier + weight * judge
