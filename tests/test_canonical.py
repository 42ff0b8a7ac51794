"""Canonicalisers: equal meaning gives equal strings, different meaning different ones, nothing
usable gives None."""

from __future__ import annotations

import pytest

from meshrl.replay.canonical import canonicalise, code, math_answer, plain_text, tool_call


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,000.", "1000"),
        ("42.0", "42"),
        ("+7", "7"),
        ("so it is -3", "-3"),
        ("the range 3-7", "7"),  # a dash between numbers is not a sign
        ("half is 0.5", "1/2"),
        ("6/8 of the cake", "3/4"),
        ("first 12, then 5 apples", "5"),
        ("<answer>  12 </answer> and later 99", "12"),
        ("<answer>x = 5</answer>", "5"),
        ("<answer>18 dollars</answer>", "18"),
        ("<answer>1, 2</answer>", "1,2"),  # a list, not one thousand two
        (r"so \boxed{\frac{3}{4}}", "3/4"),
        (r"\boxed{-\dfrac{2}{4}}", "-1/2"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{\text{18 apples}}", "18"),
        (r"\boxed{x^2 + 1}", "x^2+1"),  # marked symbolic answers are kept whole
        (r"\boxed{\{1, 2\}} is not the last: \boxed{7}", "7"),
        ("#### 1,234", "1234"),
        ("no numbers here", None),
        ("version v1.5", None),
        ("<answer> </answer> 3", None),  # an empty marked answer is not replaced by a stray number
        ("", None),
    ],
)
def test_math_answer(text, expected):
    assert math_answer(text) == expected


def test_math_answers_that_must_differ():
    assert math_answer("3/4") != math_answer("0.7")
    assert math_answer("1,000") != math_answer("1.000")


FUNCTION = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "variant",
    [
        FUNCTION,
        f"Here you go:\n```python\n{FUNCTION}```\nHope it helps.",
        "```py\ndef add(a,b):  # sum\n\n    return (a+b)\n```",
        '```\ndef add(a, b):\n    """Add two numbers."""\n    return a + b\n```',
        "```python\nprint(add(1, 2))\n```\nand the solution:\n```python\n# the function\ndef add( a, b ):\n    return a+b\n```",
        "```python\ndef add(a, b):\n    return a + b\n",  # unclosed fence (truncated generation)
    ],
)
def test_code_variants_are_equal(variant):
    assert code(variant) == code(FUNCTION) == "def add(a, b):\n    return a + b"


def test_code_differences_survive():
    assert code("def add(a, b):\n    return a - b") != code(FUNCTION)
    assert code("x = 'a'") == code('x = "a"')
    assert code("x = 'a'") != code("x = 'b'")


def test_unparsable_code_falls_back_to_stripped_lines():
    assert code("  def broken(:\n\n    pass   \n") == "def broken(:\n    pass"
    assert code("```python\n```") is None
    assert code("   ") is None


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "search", "arguments": {"query": "paris", "limit": 3}}',
        'Calling now: <tool_call>{"arguments": {"limit": 3, "query": "paris"}, "name": "search"}</tool_call>',
        '{"function": {"name": "search", "arguments": "{\\"query\\": \\"paris\\", \\"limit\\": 3}"}}',
        '```json\n{"name": " search", "parameters": {"limit": 3, "query": "paris"}}\n```',
        'I think {not json} then {"note": 1} then {"name": "search", "arguments": {"query": "paris", "limit": 3}}',
    ],
)
def test_tool_call_variants_are_equal(text):
    assert tool_call(text) == '{"arguments":{"limit":3,"query":"paris"},"name":"search"}'


@pytest.mark.parametrize(
    "text",
    ["no json", '{"arguments": {"q": 1}}', '{"name": "", "arguments": {}}', '{"name": "f", "arguments": [1]}',
     '{"name": "f", "arguments": "{broken"}', '["name", "f"]'],
)
def test_tool_call_without_a_usable_call(text):
    assert tool_call(text) is None


def test_tool_call_arguments_matter():
    assert tool_call('{"name": "f", "arguments": {"x": 1}}') != tool_call('{"name": "f", "arguments": {"x": 2}}')
    assert tool_call('{"name": "f"}') == '{"arguments":{},"name":"f"}'


def test_plain_text_folds_case_and_whitespace():
    assert plain_text("  Move   NORTH\n") == plain_text("move north") == "move north"
    assert plain_text(" \n ") is None


def test_canonicalise_dispatches_by_kind():
    assert canonicalise("math_answer", "x is 4.0") == "4"
    assert canonicalise("text", "A  B") == "a b"
    with pytest.raises(KeyError):
        canonicalise("regex", "x")  # type: ignore[arg-type]


def test_the_docs_name_the_canonicalisers_as_the_config_spells_them():
    import re
    import typing
    from pathlib import Path

    from meshrl.config.replay import CanonicaliserKind

    doc = (Path(__file__).resolve().parents[1] / "docs" / "channels.md").read_text()
    listed = re.search(r"canonicalised \((?:`replay\.teachers\.canonicaliser`:)?\s*([^)]*)\)", doc)
    assert listed, "docs/channels.md no longer lists the canonicalisers where channel 3 is described"
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(typing.get_args(CanonicaliserKind))
    for kind in typing.get_args(CanonicaliserKind):
        canonicalise(kind, "x = 1")  # every documented value is one the replay accepts
