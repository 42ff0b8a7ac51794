"""Canonical forms of actions, so that a teacher's and the student's action compare equal when they
mean the same thing. Each canonicaliser maps raw model text to a canonical string, or to None when
the text holds nothing usable of that kind.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

from meshrl.config.replay import CanonicaliserKind

# ---------------------------------------------------------------------------------------------
# math answers

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
GSM8K_ANSWER = re.compile(r"####\s*([^\n]+)")
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?")
THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
LATEX_TEXT = re.compile(r"\\(?:text|mathrm|mbox)\s*\{([^{}]*)\}")
LATEX_NOISE = re.compile(r"\\left|\\right|\\[,!;: ]|\$|\\%|%")
NUMBER_AMONG_WORDS = re.compile(rf"[A-Za-z\s:]*?({NUMBER.pattern})[A-Za-z\s.]*")
"""A number with only words around it: "18 dollars", "about 7 apples"."""
EQUATION = re.compile(r"[A-Za-z]\w*\s*=\s*(.+)", re.S)
"""A single-variable assignment such as "x = 5", whose right-hand side is the answer."""


def _number(text: str) -> str | None:
    """Canonical rational: ``"1,000"``, ``"1000.0"``, ``"+1000"`` give ``"1000"``; ``"0.5"``,
    ``"2/4"`` give ``"1/2"``."""
    if "," in text and not THOUSANDS.fullmatch(text):  # "1,2" is a list, not a number
        return None
    try:
        value = Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return str(value)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def _marked_answer(text: str) -> str | None:
    """Canonical form of an explicitly marked answer: a number if it is one (possibly the right
    side of ``x = ...`` or with words around it), else the expression without whitespace and LaTeX
    spacing."""
    expr = LATEX_TEXT.sub(r"\1", LATEX_FRACTION.sub(r"(\1)/(\2)", text))
    expr = LATEX_NOISE.sub("", expr).strip().rstrip(".")
    equation = EQUATION.fullmatch(expr)
    if equation:
        expr = equation[1]
    compact = re.sub(r"\((-?[\d.,]+)\)", r"\1", re.sub(r"\s+", "", expr))
    number = _number(compact)
    if number is None and (among_words := NUMBER_AMONG_WORDS.fullmatch(expr)):
        number = _number(among_words[1])
    return number if number is not None else (compact or None)


def math_answer(text: str) -> str | None:
    """The final answer: the last ``<answer>`` tag, else the last ``\\boxed{}``, else a GSM8K
    ``#### answer`` line, else the last number in the text. Marked answers are taken whole
    (``\\boxed{x+1}`` gives ``x+1``); only unmarked text falls back to its last number."""
    tags = ANSWER_TAG.findall(text)
    if tags:
        return _marked_answer(tags[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return _marked_answer(boxed)
    gsm = GSM8K_ANSWER.findall(text)
    if gsm:
        return _marked_answer(gsm[-1])
    numbers = NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None


# ---------------------------------------------------------------------------------------------
# code

FENCED_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


class _DropDocstrings(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return node


def code(text: str) -> str | None:
    """The longest fenced code block (or the whole text if there is none; an unclosed fence runs
    to the end), parsed as Python and unparsed without comments and docstrings so layout, quoting
    and comments do not matter. Text that does not parse is compared line by line, with trailing
    whitespace and blank lines dropped."""
    blocks = FENCED_BLOCK.findall(text)
    source = max(blocks, key=len) if blocks else text
    try:
        return ast.unparse(_DropDocstrings().visit(ast.parse(source))) or None
    except (SyntaxError, ValueError, RecursionError):
        lines = [line.rstrip() for line in source.strip().splitlines()]
        return "\n".join(line for line in lines if line) or None


# ---------------------------------------------------------------------------------------------
# tool calls


def _json_objects(text: str) -> Iterator[Any]:
    """Every JSON value that starts at a ``{`` in the text, left to right, without overlaps."""
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        yield value
        i = text.find("{", end)


def _as_tool_call(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI tool_calls entry
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"].strip(), "arguments": arguments}


def tool_call(text: str) -> str | None:
    """The first JSON object in the text shaped like a tool call — ``{"name", "arguments"}`` (or
    ``"parameters"``, or arguments as a JSON string, or wrapped in ``{"function": ...}``) — as
    compact JSON with sorted keys."""
    for obj in _json_objects(text):
        call = _as_tool_call(obj)
        if call is not None:
            return json.dumps(call, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return None


# ---------------------------------------------------------------------------------------------
# plain text


def plain_text(text: str) -> str | None:
    """Case-folded text with runs of whitespace collapsed to one space."""
    return " ".join(text.casefold().split()) or None


CANONICALISERS: dict[str, Callable[[str], str | None]] = {
    "math_answer": math_answer,
    "code": code,
    "tool_call": tool_call,
    "text": plain_text,
}


def canonicalise(kind: CanonicaliserKind, text: str) -> str | None:
    """Canonical form of ``text`` under the canonicaliser ``kind``."""
    return CANONICALISERS[kind](text)
