"""The grader's pure parts: the data-only codec between the grader and the candidate's worker, and
the strict comparison with expected literals."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.envs._worker import MAX_DEPTH, CodecError, decode, encode
from meshrl.envs.grading import same


def _wire(value):
    """What travels: encode, through JSON text, decode."""
    return decode(json.loads(json.dumps(encode(value))))


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2 ** 70, 1.5, float("inf"), "", "héllo\n", b"\x00\xff", 1 + 2j,
    [1, [2, (3, 4)]], (), (1,), {"a": 1, 2: [None]}, {(1, 2): {3}}, {1, 2}, frozenset({"x"}), set(),
])
def test_builtin_data_round_trips_with_its_types(value):
    got = _wire(value)
    assert got == value and type(got) is type(value)
    assert same(got, value)


def test_subclasses_travel_as_their_builtin_base():
    class Liar(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class L(list):
        pass

    got = _wire([Liar(3), L([1])])
    assert got == [3, [1]] and type(got[0]) is int and type(got[1]) is list
    assert _wire(True) is True and type(_wire(Liar(0))) is int


@pytest.mark.parametrize("value", [object(), iter([1]), lambda: 1, [object()], {1: object()}])
def test_anything_else_is_refused_when_sent(value):
    with pytest.raises(CodecError, match="cannot be sent"):
        encode(value)


def test_nesting_is_bounded_both_ways():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(CodecError, match="deeper"):
        encode(deep)
    wire = []
    for _ in range(MAX_DEPTH + 5):
        wire = [wire]
    with pytest.raises(CodecError, match="deeper"):
        decode(wire)
    loop: list = []
    loop.append(loop)
    with pytest.raises(CodecError):
        encode(loop)


@pytest.mark.parametrize("wire", [
    {"tuple": [1], "set": [2]}, {"list": [1]}, {"tuple": "ab"}, {"set": [[1]]}, {"dict": [[[1], 2]]},
    {"dict": [[1]]}, {"bytes": "zz"}, {"complex": [1, "2"]}, {"__class__": "os.system"},
])
def test_a_malformed_encoding_is_refused(wire):
    with pytest.raises(CodecError):
        decode(wire)


def test_same_is_strict_about_types_and_tolerant_about_floats():
    assert same(3, 3.0) and same(3.0000001, 3.0) and not same(3.1, 3.0)
    assert not same(3.0, 3) and not same(True, 1) and not same(1, True)
    assert same(math.nan, math.nan) and not same(1.0, math.nan)
    assert same([1, (2.0, "a")], [1, (2.0, "a")]) and not same([1, [2.0, "a"]], [1, (2.0, "a")])
    assert not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2}) and not same({"b": 1}, {"a": 1})
    assert same({"a": 1.0}, {"a": 1.0000000001}) and same({1, 2}, {2, 1}) and not same({1}, frozenset({1}))
