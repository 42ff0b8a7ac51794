"""Channel 2 data preparation (pure, token-level): find error sites in trajectories, render the
hint for each, and build the teacher's context by inserting the hint at the error turn.

Token alignment: the teacher scores exactly the student's response tokens. Its context is the
student's own prefix tokens up to the error turn's generation header, with one extra user turn
holding the hint inserted just before that header. Nothing is decoded or re-tokenised: the
student prefix and response are reused token for token, and only the hint text is encoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from meshrl.renderers.base import Renderer


@dataclass(frozen=True)
class ErrorSite:
    """One trajectory's error turn, with the student and teacher sequences that score it.

    ``student_tokens[student_start : student_start + length]`` and
    ``teacher_tokens[teacher_start : teacher_start + length]`` are the same response tokens.
    """

    trajectory_id: str
    kind: str
    hint: str
    student_tokens: list[int]
    student_start: int
    teacher_tokens: list[int]
    teacher_start: int
    length: int
    sampler_logprobs: list[float]
    """The sampler's logprobs of the response tokens (for the optional IS weight)."""


def error_kind(info: dict) -> str | None:
    """The error kind of a scored trajectory: the environment's/verifier's `error_kind` if given,
    else a verifier failure (`wrong_format` when no answer was found, `wrong_answer` otherwise)."""
    if info.get("error_kind"):
        return str(info["error_kind"])
    if info.get("error"):
        return None  # the grader itself failed: no evidence about the policy
    if info.get("correct", True):
        return None
    return "wrong_format" if info.get("format_ok") is False else "wrong_answer"


def render_hint(templates: dict[str, str], key: str, fields: dict[str, Any]) -> str | None:
    """Fill template ``key`` with ``fields`` (unknown fields render as `?`); None if no template."""
    template = templates.get(key)
    if template is None:
        return None

    class _Blank(dict):
        def __missing__(self, k):
            return "?"

    return template.format_map(_Blank(fields))


def insert_hint(renderer: Renderer, prefix_tokens: Sequence[int], hint: str) -> list[int]:
    """Teacher context: ``prefix_tokens`` (ending with the error turn's generation header) with a
    user turn carrying ``hint`` inserted right before that header."""
    header = renderer.generation_header()
    if list(prefix_tokens[len(prefix_tokens) - len(header):]) != header:
        raise ValueError("hint insertion: the prefix does not end with the assistant generation header")
    hint_turn = renderer.render_turn({"role": "user", "content": hint}, is_first=False).tokens
    return list(prefix_tokens[: len(prefix_tokens) - len(header)]) + hint_turn + header


def build_error_site(renderer: Renderer, trajectory, hint: str, kind: str) -> ErrorSite:
    """The error site of a trajectory. The error turn is the span ``info["error_span"]`` of its
    tokens (multi-turn episodes), or its whole response (single turn)."""
    start, end = trajectory.info.get("error_span") or (0, len(trajectory.tokens))
    prefix = list(trajectory.prompt_tokens) + list(trajectory.tokens[:start])
    response = list(trajectory.tokens[start:end])
    teacher_prefix = insert_hint(renderer, prefix, hint)
    return ErrorSite(
        trajectory_id=trajectory.id,
        kind=kind,
        hint=hint,
        student_tokens=prefix + response,
        student_start=len(prefix),
        teacher_tokens=teacher_prefix + response,
        teacher_start=len(teacher_prefix),
        length=len(response),
        sampler_logprobs=list(trajectory.logprobs[start:end]),
    )


def hint_fields(trajectory) -> dict[str, Any]:
    """Fields a hint template may use: the problem's answer and metadata, the verifier's info."""
    problem = trajectory.problem
    fields: dict[str, Any] = dict(getattr(problem, "meta", {}) or {})
    fields["answer"] = getattr(problem, "answer", "?")
    fields.update({k: v for k, v in trajectory.info.items() if isinstance(v, (str, int, float))})
    return fields


def select_error_sites(renderer: Renderer, trajectories: list, templates: dict[str, str],
                       limit: int, hint_source=None) -> tuple[list[ErrorSite], dict[str, int]]:
    """Error sites of a step (at most ``limit``), each with its hint; counts by outcome.
    ``hint_source(trajectories, kinds) -> list[str | None]`` (e.g. an LLM) is asked first; the
    environment's hint and the templates fill in where it has none."""
    sites: list[ErrorSite] = []
    counts = {"error_sites": 0, "hints": 0, "llm_hints": 0, "no_hint_template": 0, "empty_response": 0}
    failed = [(t, error_kind(t.info)) for t in trajectories]
    failed = [(t, k) for t, k in failed if k is not None]
    candidates = [(t, k) for t, k in failed if t.tokens][:limit]
    generated = hint_source([t for t, _ in candidates], [k for _, k in candidates]) if hint_source else []
    generated_by_id = {t.id: h for (t, _), h in zip(candidates, generated) if h}
    for t in trajectories:
        kind = error_kind(t.info)
        if kind is None:
            continue
        counts["error_sites"] += 1
        if not t.tokens:
            counts["empty_response"] += 1
            continue
        hint = generated_by_id.get(t.id)
        if hint:
            counts["llm_hints"] += 1
        else:
            hint = t.info.get("hint") or render_hint(templates, t.info.get("hint_template_key") or kind,
                                                     hint_fields(t))
        if not hint:
            counts["no_hint_template"] += 1
            continue
        if len(sites) < limit:
            sites.append(build_error_site(renderer, t, hint, kind))
            counts["hints"] += 1
    return sites, counts
