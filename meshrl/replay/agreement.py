"""k-of-N agreement between teachers, turned into DPO preference pairs against the student.

Rules, for one student step with canonical action Y and N teacher answers:

- teachers whose call failed, or whose reply has no usable action (canonical None), do not vote;
- fewer than k votes in total: no pair (``too_few_answers``);
- every voter chose Y: no pair (``all_agree_with_student``);
- no action has k votes: no pair (``no_majority``);
- two or more actions each have k votes (possible when k <= N/2): no pair (``tie``). The teachers
  are split into competing agreeing groups, so the label is unreliable and we do not pick a side,
  even when one group is larger;
- exactly one action X has k votes and X == Y: no pair (``student_matches_majority``);
- exactly one action X has k votes and X != Y: pair, chosen = the raw reply of the first teacher
  (in teacher order) that chose X, rejected = the student's raw text. A student step without a
  usable action (Y is None) differs from every X, so it yields a pair when teachers agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

NoPairReason = Literal[
    "too_few_answers",
    "all_agree_with_student",
    "no_majority",
    "tie",
    "student_matches_majority",
]


@dataclass(frozen=True)
class TeacherAnswer:
    """One teacher's answer to one student step. ``text`` is None if the call failed; ``canonical``
    is None if it failed or the reply held no usable action."""

    teacher: str
    text: str | None
    canonical: str | None

    def __post_init__(self) -> None:
        if self.canonical is not None and self.text is None:
            raise ValueError(f"teacher {self.teacher}: a canonical action needs the reply text")


@dataclass(frozen=True)
class PreferencePair:
    """A DPO pair: the teachers' agreed action is preferred over the student's."""

    chosen: str
    """Raw reply of the first teacher that gave the agreed action."""
    rejected: str
    """The student's raw action text."""
    chosen_canonical: str
    rejected_canonical: str | None
    votes: int
    """Teachers that gave the agreed action."""
    n_teachers: int
    """Teachers asked (N), including those that failed."""
    n_answered: int
    """Teachers that gave a usable action."""
    agreeing_teachers: tuple[str, ...]


@dataclass(frozen=True)
class PairDecision:
    """The outcome for one step: a pair, or the reason there is none."""

    pair: PreferencePair | None
    reason: NoPairReason | None
    votes: dict[str, int]
    """Votes per canonical action."""


def decide_pair(
    student_text: str,
    student_canonical: str | None,
    answers: Sequence[TeacherAnswer],
    k: int,
) -> PairDecision:
    """Apply the k-of-N rules in the module docstring to one student step."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    voters = [a for a in answers if a.canonical is not None]
    votes = Counter(a.canonical for a in voters)
    tally = dict(votes)

    def no_pair(reason: NoPairReason) -> PairDecision:
        return PairDecision(pair=None, reason=reason, votes=tally)

    if len(voters) < k:
        return no_pair("too_few_answers")
    if set(votes) == {student_canonical}:
        return no_pair("all_agree_with_student")
    winners = [action for action, count in votes.items() if count >= k]
    if not winners:
        return no_pair("no_majority")
    if len(winners) > 1:
        return no_pair("tie")
    agreed = winners[0]
    if agreed == student_canonical:
        return no_pair("student_matches_majority")
    agreeing = [a for a in voters if a.canonical == agreed]
    chosen = agreeing[0].text
    assert chosen is not None  # guaranteed by TeacherAnswer
    pair = PreferencePair(
        chosen=chosen,
        rejected=student_text,
        chosen_canonical=agreed,
        rejected_canonical=student_canonical,
        votes=len(agreeing),
        n_teachers=len(answers),
        n_answered=len(voters),
        agreeing_teachers=tuple(a.teacher for a in agreeing),
    )
    return PairDecision(pair=pair, reason=None, votes=tally)
