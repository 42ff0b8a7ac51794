"""Channel 2 data preparation (pure, token-level): find error sites in trajectories (every failing
turn of a multi-turn episode, the response of a failed single-turn one), render the hint for each,
and build the teacher's context by inserting the hint at the error turn.

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


@dataclass(frozen=True)
class FailingTurn:
    """A turn of a trajectory whose action was wrong: where the error happened, before its hint."""

    trajectory: Any
    start: int
    """``trajectory.tokens[start:end]`` is the turn's response."""
    end: int
    kind: str
    env_hint: str | None
    """The environment's own hint for the turn, if it gave one."""
    template_key: str | None
    """The hint template the environment asks for (default: ``kind``)."""
    context: list[dict] | None
    """The chat messages the student saw at the turn (multi-turn episodes), for an LLM hint."""
    error_text: str | None
    fields: dict[str, Any]
    """What a hint template may use: the problem's answer and metadata, the turn's error info."""


def failing_turns(trajectory, limit: int) -> list[FailingTurn]:
    """The error sites of a trajectory, at most ``limit`` (its earliest): a multi-turn episode's
    every turn whose action failed (``info["turn_errors"]``, aligned with ``info["turns"]``: None
    for a turn that solved the task), in a failed or a successful episode; a single-turn
    trajectory's whole response when the verifier failed it."""
    info = trajectory.info
    turns, errors = info.get("turns"), info.get("turn_errors")
    if not turns:
        kind = error_kind(info)
        if kind is None:
            return []
        return [FailingTurn(trajectory, 0, len(trajectory.tokens), kind, info.get("hint"),
                            info.get("hint_template_key"), None, info.get("error_text"), hint_fields(trajectory))]
    if errors is None or len(errors) != len(turns):
        raise ValueError(f"trajectory {trajectory.id}: info['turn_errors'] must give one entry per turn")
    out = []
    for (context, _, start, end), err in zip(turns, errors):
        if err is None:
            continue
        fields = {**hint_fields(trajectory), **{k: v for k, v in err.items() if isinstance(v, (str, int, float))}}
        out.append(FailingTurn(trajectory, start, end, err.get("error_kind") or "test_failure", err.get("hint"),
                               err.get("hint_template_key"), list(context or []), err.get("error_text"), fields))
    return out[:limit]


def build_error_site(renderer: Renderer, turn: FailingTurn, hint: str) -> ErrorSite:
    """The error site of a failing turn: the student's own tokens up to the turn, the teacher's
    context with ``hint`` inserted before the turn's generation header, and the turn's response."""
    t = turn.trajectory
    prefix = list(t.prompt_tokens) + list(t.tokens[: turn.start])
    response = list(t.tokens[turn.start : turn.end])
    teacher_prefix = insert_hint(renderer, prefix, hint)
    return ErrorSite(
        trajectory_id=t.id,
        kind=turn.kind,
        hint=hint,
        student_tokens=prefix + response,
        student_start=len(prefix),
        teacher_tokens=teacher_prefix + response,
        teacher_start=len(teacher_prefix),
        length=len(response),
        sampler_logprobs=list(t.logprobs[turn.start : turn.end]),
    )


def hint_fields(trajectory) -> dict[str, Any]:
    """Fields a hint template may use: the problem's answer and metadata, the verifier's info."""
    problem = trajectory.problem
    fields: dict[str, Any] = dict(getattr(problem, "meta", {}) or {})
    fields["answer"] = getattr(problem, "answer", "?")
    fields.update({k: v for k, v in trajectory.info.items() if isinstance(v, (str, int, float))})
    return fields


def select_error_sites(renderer: Renderer, trajectories: list, templates: dict[str, str], limit: int,
                       per_episode: int, hint_source=None) -> tuple[list[ErrorSite], dict[str, int]]:
    """Error sites of a step (at most ``limit``; at most ``per_episode`` from one trajectory), each
    with its hint; counts by outcome. ``hint_source(turns) -> list[str | None]`` (e.g. an LLM) is
    asked first for the failing turns that can become sites; the environment's hint and the
    templates fill in where it has none."""
    sites: list[ErrorSite] = []
    counts = {"error_sites": 0, "hints": 0, "llm_hints": 0, "no_hint_template": 0, "empty_response": 0}
    failing = [turn for t in trajectories for turn in failing_turns(t, per_episode)]
    candidates = [turn for turn in failing if turn.end > turn.start][:limit]
    generated = hint_source(candidates) if hint_source else []
    generated_at = {(turn.trajectory.id, turn.start): h for turn, h in zip(candidates, generated) if h}
    for turn in failing:
        counts["error_sites"] += 1
        if turn.end == turn.start:
            counts["empty_response"] += 1
            continue
        hint = generated_at.get((turn.trajectory.id, turn.start))
        if hint:
            counts["llm_hints"] += 1
        else:
            hint = turn.env_hint or render_hint(templates, turn.template_key or turn.kind, turn.fields)
        if not hint:
            counts["no_hint_template"] += 1
            continue
        if len(sites) < limit:
            sites.append(build_error_site(renderer, turn, hint))
            counts["hints"] += 1
    return sites, counts
