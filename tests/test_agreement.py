"""The k-of-N pair extraction table."""

from __future__ import annotations

import pytest

from meshrl.replay.agreement import TeacherAnswer, decide_pair

FAILED = None  # a teacher whose call failed


def answers(*canonicals: str | None) -> list[TeacherAnswer]:
    """Teachers t0, t1, ... answering with the given canonical actions (raw text 'raw-<i>-<x>')."""
    return [
        TeacherAnswer(f"t{i}", None if c is None else f"raw-{i}-{c}", c) for i, c in enumerate(canonicals)
    ]


# (student canonical, teacher canonicals, k, expected reason or None for a pair, expected chosen canonical)
TABLE = [
    ("4", ["4", "4", "4"], 2, "all_agree_with_student", None),
    ("4", ["1", "2", "3"], 2, "no_majority", None),
    ("4", ["5", "5", "4"], 2, None, "5"),  # 2-of-3 against the student
    ("4", ["5", "4", "5"], 2, None, "5"),
    ("4", ["5", "5", "5"], 2, None, "5"),  # unanimous against the student
    ("4", ["4", "4", "5"], 2, "student_matches_majority", None),
    ("4", ["5", "5", "6", "6"], 2, "tie", None),  # two groups reach k
    ("4", ["5", "5", "5", "6", "6"], 2, "tie", None),  # still contested although 5 leads
    ("4", ["4", "4", "5", "5"], 2, "tie", None),  # the student's answer is one side of the tie
    ("4", ["5", "5", "5", "6", "6"], 3, None, "5"),  # with k=3 only one group reaches k
    ("4", ["5", "5", "6"], 3, "no_majority", None),
    ("4", ["5", "5", "5"], 3, None, "5"),
    ("4", ["5", FAILED, "5"], 2, None, "5"),  # failed teachers don't vote
    ("4", ["5", FAILED, FAILED], 2, "too_few_answers", None),
    ("4", [FAILED, FAILED, FAILED], 2, "too_few_answers", None),
    ("4", ["5", "5", FAILED], 3, "too_few_answers", None),
    ("4", ["4", "4", FAILED], 2, "all_agree_with_student", None),
    ("4", ["5", "6", FAILED], 2, "no_majority", None),
    (None, ["5", "5", "7"], 2, None, "5"),  # a student step without a usable action loses to agreement
    (None, ["5", "6", "7"], 2, "no_majority", None),
    ("4", ["5"], 1, None, "5"),
    ("4", ["5", "6"], 1, "tie", None),
]


@pytest.mark.parametrize("student, teachers, k, reason, chosen", TABLE)
def test_pair_table(student, teachers, k, reason, chosen):
    decision = decide_pair("student raw", student, answers(*teachers), k)
    assert decision.reason == reason
    if reason is not None:
        assert decision.pair is None
        return
    pair = decision.pair
    assert pair.chosen_canonical == chosen
    first = teachers.index(chosen)
    assert pair.chosen == f"raw-{first}-{chosen}"  # the first agreeing teacher's raw reply
    assert pair.rejected == "student raw"
    assert pair.rejected_canonical == student
    assert pair.votes == teachers.count(chosen)
    assert pair.n_teachers == len(teachers)
    assert pair.n_answered == sum(t is not None for t in teachers)
    assert pair.agreeing_teachers == tuple(f"t{i}" for i, t in enumerate(teachers) if t == chosen)


def test_votes_are_reported_per_action():
    decision = decide_pair("s", "4", answers("5", FAILED, "5", "6"), 2)
    assert decision.votes == {"5": 2, "6": 1}


def test_unusable_reply_does_not_vote():
    unusable = TeacherAnswer("t9", "I don't know", None)
    decision = decide_pair("s", "4", [*answers("5"), unusable], 2)
    assert decision.reason == "too_few_answers"


def test_invalid_inputs():
    with pytest.raises(ValueError):
        decide_pair("s", "4", answers("5", "5"), 0)
    with pytest.raises(ValueError):
        TeacherAnswer("t0", None, "5")
