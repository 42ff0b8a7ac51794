"""Write meshrl's easy code tier, ``meshrl/envs/data/code_tasks_easy.jsonl`` (`task.code.env.task_source:
meshrl_easy`): one-line functions the 135M base model sometimes gets right, so RL on code has
groups with some successes and some failures to learn from.

    python scripts/make_easy_code_tasks.py          # rewrite the file (deterministic)
    python scripts/make_easy_code_tasks.py --check  # exit 1 if the file differs from what it would write

Every task comes from a *family* (add a constant, largest of a list, join with a separator, ...).
A family has several variants, each with its own function name and, where the family has one, its
own constant; a seeded shuffle puts 30 % of each family's variants (at least one) in the
`test` split and the rest in `train`, so the held-out split measures whether a skill transfers
to new names and constants, not whether a task was memorised. Expected values are computed from
the reference solutions here and checked again in the sandbox by the test-suite.

The families were chosen by measuring the base model (`benchmarks/code_tier.py`): greedy, it
solves some of them always, most sometimes, and some never within the 32 new tokens a code turn
gets by default (it copies the docstring first), which leaves the held-out split room to improve.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from meshrl.envs.tasks import EASY_CODE_TASKS_FILE

OUT = EASY_CODE_TASKS_FILE
SOURCE = "meshrl_easy"
SEED = 0

WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine",
         10: "ten", 11: "eleven", 12: "twelve", 15: "fifteen", 20: "twenty"}

INTS = [(3,), (0,), (-4,), (10,), (27,)]
PAIRS = [(3, 8), (10, 2), (-5, 5), (0, 0), (7, -1)]
LISTS = [([3, 1, 2],), ([5],), ([-1, -7, -3],), ([10, 20, 5, 7],), ([4, 4, 9, 0],)]
LISTS_WITH_EMPTY = [([3, 1, 2],), ([],), ([-1, -7, -3, 8],), ([10, 20, 5, 7],), ([0, 0, 6],)]
STRINGS = [("hello",), ("Python",), ("",), ("a b c",), ("Data Science",)]


@dataclass(frozen=True)
class Spec:
    """One task: ``def name(params) -> returns``, documented by ``doc``, solved by ``return expr``,
    tested on ``inputs`` (argument tuples; the first is the docstring's example)."""

    family: str
    name: str
    params: str
    returns: str
    doc: str
    expr: str
    inputs: list

    @property
    def signature(self) -> str:
        return f"def {self.name}({self.params}) -> {self.returns}"

    @property
    def reference(self) -> str:
        args = ", ".join(p.split(":")[0] for p in self.params.split(", "))
        return f"def {self.name}({args}):\n    return {self.expr}\n"


def numbers(*ks: int) -> list[dict]:
    """Variants with a number ``k`` and its word ``w`` (e.g. 7, 'seven')."""
    return [{"w": WORDS[k], "k": k} for k in ks]


def named(*names: str, args: tuple[str, ...] = ()) -> list[dict]:
    """Variants with a function name ``n`` and, where given, an argument name ``a``."""
    return [{"n": n, "a": a} for n, a in zip(names, args or [""] * len(names))]


def family(family: str, variants: list[dict], name: str, params: str, returns: str, doc: str, expr: str,
           inputs) -> list[Spec]:
    """One task per variant: ``name``, ``params``, ``doc`` and ``expr`` are templates filled with the
    variant's fields; ``inputs`` is a list of argument tuples or a function of the variant."""
    return [Spec(family, name.format(**v), params.format(**v), returns.format(**v), doc.format(**v),
                 expr.format(**v), inputs(v) if callable(inputs) else inputs) for v in variants]


NUMS = ("nums", "values", "numbers", "xs", "scores", "items")
TEXTS = ("s", "text", "word", "string", "message")
UNITS = [("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
         ("feet", "inches", 12), ("meters", "centimeters", 100), ("kilometers", "meters", 1000),
         ("dollars", "cents", 100), ("years", "months", 12), ("kilograms", "grams", 1000)]
LINEAR = [("double", 2, "plus", 3), ("triple", 3, "minus", 2), ("double", 2, "minus", 5), ("triple", 3, "plus", 4),
          ("double", 2, "plus", 7), ("triple", 3, "minus", 6)]
GEOMETRY = [("perimeter_of_square", "side: int", "int", "perimeter of a square with sides of length `side`",
             "4 * side"),
            ("area_of_square", "side: int", "int", "area of a square with sides of length `side`", "side * side"),
            ("volume_of_cube", "side: int", "int", "volume of a cube with edges of length `side`", "side ** 3"),
            ("area_of_rectangle", "width: int, height: int", "int", "area of a `width` by `height` rectangle",
             "width * height"),
            ("perimeter_of_rectangle", "width: int, height: int", "int",
             "perimeter of a `width` by `height` rectangle", "2 * (width + height)"),
            ("area_of_triangle", "base: int, height: int", "float",
             "area of a triangle with base `base` and height `height`", "base * height / 2")]
THRESHOLDS = [("can_vote", "age", ">= 18", "old enough to vote (18 or older)"),
              ("is_senior", "age", ">= 65", "a senior (65 or older)"),
              ("is_child", "age", "< 13", "a child (younger than 13)"),
              ("is_freezing", "temp", "<= 0", "at or below freezing (0 degrees or less)"),
              ("is_boiling", "temp", ">= 100", "at or above boiling (100 degrees or more)"),
              ("is_passing", "score", ">= 50", "a passing score (50 or more)"),
              ("is_hot", "temp", "> 30", "hot (more than 30 degrees)")]


def families() -> list[list[Spec]]:
    """Every family of easy tasks."""
    return [
        # one number and a constant
        family("add_constant", numbers(2, 5, 7, 11), "add_{w}", "x: int", "int", "Return `x` plus {k}.",
               "x + {k}", INTS),
        family("subtract_constant", numbers(4, 6, 10, 15), "subtract_{w}", "x: int", "int",
               "Return `x` minus {k}.", "x - {k}", INTS),
        family("linear", [{"w": f"{m}_{op}_{WORDS[b]}", "m": k, "op": op, "b": b, "sign": "+" if op == "plus" else "-"}
                          for m, k, op, b in LINEAR],
               "{w}", "x: int", "int", "Return {m} times `x` {op} {b}.", "{m} * x {sign} {b}", INTS),
        family("geometry", [{"n": n, "p": p, "r": r, "what": w, "f": f} for n, p, r, w, f in GEOMETRY],
               "{n}", "{p}", "{r}", "Return the {what}.", "{f}",
               lambda v: [(3, 4), (5, 5), (0, 7), (10, 2)] if "," in v["p"] else [(2,), (5,), (0,), (11,)]),
        family("is_multiple", numbers(2, 3, 4, 5, 6, 7, 8, 9, 10, 11), "is_multiple_of_{w}", "n: int", "bool",
               "Return True if `n` is divisible by {k}, else False.", "n % {k} == 0",
               lambda v: [(3 * v["k"],), (3 * v["k"] + 1,), (0,), (v["k"] + 1,), (-v["k"],)]),
        family("at_least", numbers(3, 5, 8, 10, 12, 20), "at_least_{w}", "x: int", "bool",
               "Return True if `x` is {k} or more, else False.", "x >= {k}",
               lambda v: [(v["k"] - 1,), (v["k"],), (v["k"] + 1,), (0,), (50,)]),
        family("at_most", numbers(2, 4, 6, 9, 11, 15), "at_most_{w}", "x: int", "bool",
               "Return True if `x` is {k} or less, else False.", "x <= {k}",
               lambda v: [(v["k"] - 1,), (v["k"],), (v["k"] + 1,), (0,), (50,)]),
        family("unit_conversion", [{"src": a, "dst": b, "k": k} for a, b, k in UNITS], "{src}_to_{dst}",
               "{src}: int", "int", "Convert `{src}` (a number of {src}) to {dst}.", "{src} * {k}",
               [(1,), (0,), (3,), (10,)]),
        family("threshold", [{"n": n, "a": a, "cond": c, "what": w, "t": int(c.split()[1])}
                             for n, a, c, w in THRESHOLDS],
               "{n}", "{a}: int", "bool", "Return True if `{a}` is {what}, else False.", "{a} {cond}",
               lambda v: [(v["t"] - 1,), (v["t"],), (v["t"] + 1,), (v["t"] + 40,), (v["t"] - 40,)]),
        # one string (or list of strings) and a constant
        family("repeat_string", numbers(2, 3, 5, 10), "repeat_{w}_times", "s: str", "str",
               "Return the string `s` repeated {k} times.", "s * {k}", [("ab",), ("x",), ("",), ("hi ",)]),
        family("join_with", [{"w": w, "k": k} for w, k in (("dash", "-"), ("comma", ","), ("space", " "),
                                                             ("underscore", "_"), ("plus", "+"), ("slash", "/"),
                                                             ("colon", ":"), ("dot", "."))],
               "join_with_{w}", "words: list[str]", "str",
               "Join the strings in `words` into one string, with '{k}' between them.", "'{k}'.join(words)",
               [(["a", "b", "c"],), (["hello", "world"],), (["one"],), ([],)]),
        family("add_suffix", [{"w": w, "k": k} for w, k in (("exclamation_mark", "!"), ("question_mark", "?"),
                                                              ("period", "."), ("semicolon", ";"), ("star", "*"))],
               "add_{w}", "s: str", "str", "Return `s` with '{k}' added at the end.", "s + '{k}'",
               [("hi",), ("",), ("Hello world",), ("ok",)]),
        family("first_chars", numbers(2, 3, 4, 5), "first_{w}_chars", "s: str", "str",
               "Return the first {k} characters of `s` (all of `s` when it is shorter).", "s[:{k}]",
               [("abcdefgh",), ("",), ("hi",), ("Python code",)]),
        # one number
        family("square", named("square", "squared", "square_of", "sq", args=("x", "n", "value", "num")),
               "{n}", "{a}: int", "int", "Return `{a}` squared.", "{a} * {a}", INTS),
        family("cube", named("cube", "cubed", "cube_of", "third_power", args=("x", "n", "value", "num")),
               "{n}", "{a}: int", "int", "Return `{a}` cubed.", "{a} ** 3", INTS),
        family("is_even", named("is_even", "even", "is_even_number", "check_even", args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "bool", "Return True if `{a}` is even, else False.", "{a} % 2 == 0", INTS),
        family("is_odd", named("is_odd", "odd", "is_odd_number", "check_odd", args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "bool", "Return True if `{a}` is odd, else False.", "{a} % 2 == 1", INTS),
        family("is_positive", named("is_positive", "positive", "above_zero", "check_positive",
                                    args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "bool", "Return True if `{a}` is greater than 0, else False.", "{a} > 0", INTS),
        family("is_negative", named("is_negative", "negative", "below_zero", "check_negative",
                                    args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "bool", "Return True if `{a}` is less than 0, else False.", "{a} < 0", INTS),
        family("negate", named("negate", "opposite", "flip_sign", "negative_of", args=("x", "n", "value", "num")),
               "{n}", "{a}: int", "int", "Return `{a}` with its sign flipped.", "-{a}", INTS),
        family("absolute", named("absolute", "abs_value", "magnitude", "distance_from_zero",
                                 args=("x", "n", "value", "num")),
               "{n}", "{a}: int", "int", "Return the absolute value of `{a}`.", "abs({a})", INTS),
        family("last_digit", named("last_digit", "ones_digit", "final_digit", "units_digit",
                                   args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "int", "Return the last digit of the non-negative integer `{a}`.", "{a} % 10",
               [(123,), (7,), (0,), (4580,), (99,)]),
        family("to_string", named("to_string", "int_to_str", "number_to_text", "stringify",
                                  args=("n", "x", "num", "value")),
               "{n}", "{a}: int", "str", "Return the integer `{a}` written as a string.", "str({a})", INTS),
        # one string
        family("to_int", named("to_int", "parse_int", "str_to_int", "text_to_number", args=TEXTS),
               "{n}", "{a}: str", "int", "Return the integer written in the string `{a}`.", "int({a})",
               [("42",), ("0",), ("-7",), ("1000",)]),
        family("upper", named("to_upper", "shout", "uppercase", "make_upper", "all_caps", args=TEXTS),
               "{n}", "{a}: str", "str", "Return `{a}` with every letter in upper case.", "{a}.upper()", STRINGS),
        family("lower", named("to_lower", "whisper", "lowercase", "make_lower", "no_caps", args=TEXTS),
               "{n}", "{a}: str", "str", "Return `{a}` with every letter in lower case.", "{a}.lower()", STRINGS),
        family("reverse_string", named("reverse_string", "backwards", "reverse_word", "flip_string", args=TEXTS),
               "{n}", "{a}: str", "str", "Return the string `{a}` reversed.", "{a}[::-1]", STRINGS),
        family("string_length", named("string_length", "text_length", "num_chars", "count_chars", args=TEXTS),
               "{n}", "{a}: str", "int", "Return the number of characters in `{a}`.", "len({a})", STRINGS),
        family("count_words", named("count_words", "word_count", "num_words", "how_many_words",
                                    args=("s", "text", "sentence", "line")),
               "{n}", "{a}: str", "int", "Return the number of words in `{a}` (words are separated by spaces).",
               "len({a}.split())", STRINGS),
        family("remove_spaces", named("remove_spaces", "strip_spaces", "no_spaces", "squash",
                                      args=("s", "text", "line", "sentence")),
               "{n}", "{a}: str", "str", "Return `{a}` with every space removed.", "{a}.replace(' ', '')", STRINGS),
        family("first_word", named("first_word", "get_first_word", "opening_word", "leading_word",
                                   args=("s", "text", "sentence", "line")),
               "{n}", "{a}: str", "str", "Return the first word of `{a}` (words are separated by spaces; there "
               "is at least one).", "{a}.split()[0]", [("hello world",), ("one",), ("a b c",), ("Data Science",)]),
        family("last_word", named("last_word", "get_last_word", "final_word", "closing_word",
                                  args=("s", "text", "sentence", "line")),
               "{n}", "{a}: str", "str", "Return the last word of `{a}` (words are separated by spaces; there "
               "is at least one).", "{a}.split()[-1]", [("hello world",), ("one",), ("a b c",), ("Data Science",)]),
        family("even_length", named("has_even_length", "is_even_length", "even_length", "length_is_even",
                                    args=TEXTS),
               "{n}", "{a}: str", "bool", "Return True if `{a}` has an even number of characters, else False.",
               "len({a}) % 2 == 0", STRINGS),
        family("first_char", named("first_letter", "initial", "first_char", "get_first_letter", args=TEXTS),
               "{n}", "{a}: str", "str", "Return the first character of the non-empty string `{a}`.", "{a}[0]",
               [("hello",), ("Python",), ("x",), ("a b c",)]),
        family("last_char", named("last_letter", "last_char", "final_letter", "ending_letter", args=TEXTS),
               "{n}", "{a}: str", "str", "Return the last character of the non-empty string `{a}`.", "{a}[-1]",
               [("hello",), ("Python",), ("x",), ("a b c",)]),
        # two numbers or two strings
        family("abs_diff", named("distance", "abs_diff", "difference", "gap"), "{n}", "a: int, b: int", "int",
               "Return the absolute difference between `a` and `b`.", "abs(a - b)", PAIRS),
        family("bigger", named("bigger", "larger", "max_of_two", "greater"), "{n}", "a: int, b: int", "int",
               "Return the larger of `a` and `b`.", "max(a, b)", PAIRS),
        family("smaller", named("smaller", "lesser", "min_of_two", "lower_of"), "{n}", "a: int, b: int", "int",
               "Return the smaller of `a` and `b`.", "min(a, b)", PAIRS),
        family("add_pair", named("add", "plus", "sum_two", "add_numbers"), "{n}", "a: int, b: int", "int",
               "Return the sum of `a` and `b`.", "a + b", PAIRS),
        family("subtract_pair", named("subtract", "minus", "take_away", "sub"), "{n}", "a: int, b: int", "int",
               "Return `a` minus `b`.", "a - b", PAIRS),
        family("multiply_pair", named("multiply", "product", "mul", "times_together"), "{n}", "a: int, b: int",
               "int", "Return the product of `a` and `b`.", "a * b", PAIRS),
        family("sum_of_squares", named("sum_of_squares", "square_sum", "add_squares", "squares_total"), "{n}",
               "a: int, b: int", "int", "Return `a` squared plus `b` squared.", "a * a + b * b", PAIRS),
        family("is_equal", named("is_equal", "same", "equal", "are_equal"), "{n}", "a: int, b: int", "bool",
               "Return True if `a` and `b` are equal, else False.", "a == b", PAIRS),
        family("divides", named("is_divisible", "divides_evenly", "can_divide", "no_remainder"), "{n}",
               "a: int, b: int", "bool", "Return True if `a` is divisible by `b` (never 0), else False.",
               "a % b == 0", [(10, 5), (7, 2), (0, 3), (-9, 3), (9, 4)]),
        family("average_two", named("average", "mean_of_two", "midpoint", "avg"), "{n}", "a: int, b: int", "float",
               "Return the average of `a` and `b` as a float.", "(a + b) / 2", PAIRS),
        family("concat", named("concat", "combine", "join_two", "glue"), "{n}", "a: str, b: str", "str",
               "Return the string `a` followed by the string `b`.", "a + b",
               [("ab", "cd"), ("", "x"), ("hello ", "world"), ("1", "2")]),
        # one list
        family("largest", named("largest", "max_value", "biggest", "maximum", "highest_score", "find_max", args=NUMS),
               "{n}", "{a}: list[int]", "int", "Return the largest number in `{a}` (never empty).", "max({a})", LISTS),
        family("total", named("total", "sum_list", "add_all", "list_sum", "total_score", "sum_items", args=NUMS),
               "{n}", "{a}: list[int]", "int", "Return the sum of the numbers in `{a}`.", "sum({a})",
               LISTS_WITH_EMPTY),
        family("length", named("count_items", "list_length", "size", "num_elements", "how_many", args=NUMS),
               "{n}", "{a}: list[int]", "int", "Return how many elements `{a}` has.", "len({a})", LISTS_WITH_EMPTY),
    ]


def split_of(specs: list[Spec]) -> dict[str, str]:
    """Function name -> split: a seeded 30 % of the family (at least one) is held out."""
    names = [s.name for s in specs]
    random.Random(f"{SEED}:{specs[0].family}").shuffle(names)
    n_test = max(1, round(0.3 * len(names)))
    return {n: ("test" if i < n_test else "train") for i, n in enumerate(names)}


def record(spec: Spec, split: str) -> dict:
    """The task's JSON record; expected values come from running the reference."""
    namespace: dict = {}
    exec(spec.reference, namespace)  # our own one-line reference, not model output
    fn = namespace[spec.name]
    calls = [f"{spec.name}({', '.join(repr(a) for a in args)})" for args in spec.inputs]
    expected = [repr(fn(*args)) for args in spec.inputs]
    prompt = f'{spec.signature}:\n    """{spec.doc}\n\n    >>> {calls[0]}\n    {expected[0]}\n    """'
    return {
        "task_id": f"easy/{spec.name}", "prompt": prompt, "entry_point": spec.name,
        "tests": [{"call": c, "expected": e} for c, e in zip(calls, expected)],
        "difficulty": 1, "split": split, "source": SOURCE, "preamble": "", "test_setup": "",
        "reference": spec.reference, "metadata": {"signature": spec.signature, "family": spec.family},
    }


def render() -> str:
    """The whole file: every family's tasks, train and test, in family order."""
    lines, seen = [], set()
    for specs in families():
        names = {s.name for s in specs}
        if names & seen or len(names) < len(specs):
            raise ValueError(f"function names used twice: {sorted(names & seen) or specs[0].family}")
        seen |= names
        splits = split_of(specs)
        lines += [json.dumps(record(s, splits[s.name]), ensure_ascii=False) for s in specs]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the file on disk")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        print("up to date" if current == text else f"{OUT} is stale: rerun {Path(__file__).name}")
        return 0 if current == text else 1
    OUT.write_text(text, encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines()]
    print(f"wrote {OUT}: {sum(r['split'] == 'train' for r in rows)} train, "
          f"{sum(r['split'] == 'test' for r in rows)} test tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
