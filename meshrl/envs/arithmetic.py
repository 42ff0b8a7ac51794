"""Procedurally generated arithmetic: 'What is a + b?' with a verifiable integer answer.

The problem space (every operand pair and operator) is enumerated once, a fixed-seed shuffle
puts the first ``heldout_size`` problems aside for evaluation, and training draws from the rest
in a seeded, resumable order (:class:`meshrl.envs.task_sets.SeededStream`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from meshrl.config.task import ArithmeticConfig

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
"""The operators a problem may use, and what each computes (also what the oracle teacher answers)."""
_INT = re.compile(r"(?<![\d.])[-+−]?\d{1,3}(?:,\d{3})+(?![\d,])|(?<![\d.])[-+−]?\d+")


@dataclass(frozen=True)
class Problem:
    """One task instance: the chat messages shown to the policy and the verifiable answer."""

    id: str
    messages: tuple[dict, ...]
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


def extract_last_integer(text: str) -> int | None:
    """The last integer in ``text`` (thousands separators and a leading sign allowed), or None."""
    matches = _INT.findall(text or "")
    if not matches:
        return None
    raw = matches[-1].replace(",", "").replace("−", "-")
    try:
        return int(raw)
    except ValueError:
        return None


def grade_integer_answer(response: str, answer: str) -> tuple[float, dict]:
    """Reward 1 if the last integer of the response equals the answer, else 0; never raises."""
    got = extract_last_integer(response)
    correct = got is not None and str(got) == str(answer).strip()
    info = {"extracted": got, "correct": correct, "format_ok": got is not None}
    if not correct:
        kind = "wrong_answer" if got is not None else "wrong_format"
        info.update(error_kind=kind, hint_template_key=f"math.{kind}")
    return (1.0 if correct else 0.0), info


class ArithmeticTask:
    """Deterministic train stream and held-out set of arithmetic problems."""

    multi_turn = False

    def __init__(self, cfg: ArithmeticConfig, data_seed: int = 0):
        from meshrl.envs.task_sets import SeededStream

        self.cfg = cfg
        space = [
            (a, op, b)
            for op in cfg.operators
            for a in range(cfg.min_value, cfg.max_value + 1)
            for b in range(cfg.min_value, cfg.max_value + 1)
        ]
        random.Random(cfg.seed).shuffle(space)
        self._heldout = space[: cfg.heldout_size]
        self._train = space[cfg.heldout_size :]
        self._stream = SeededStream(self._train, data_seed)

    def _problem(self, split: str, index: int, triple: tuple[int, str, int]) -> Problem:
        a, op, b = triple
        user = self.cfg.prompt_template.format(a=a, op=op, b=b)
        messages: list[dict] = []
        if self.cfg.system_prompt is not None:
            messages.append({"role": "system", "content": self.cfg.system_prompt})
        messages.append({"role": "user", "content": user})
        answer = str(OPERATIONS[op](a, b))
        return Problem(f"{split}-{index}", tuple(messages), answer, {"a": a, "op": op, "b": b})

    def heldout(self, n: int | None = None) -> list[Problem]:
        """The first ``n`` held-out problems (all by default), always the same ones."""
        items = self._heldout if n is None else self._heldout[:n]
        return [self._problem("heldout", i, t) for i, t in enumerate(items)]

    def train_batch(self, cursor: int, n: int) -> list[Problem]:
        """Training problems ``cursor .. cursor+n`` of the endless seeded stream (epochs reshuffle)."""
        return [self._problem("train", k, triple) for k, triple in self._stream.batch(cursor, n)]

    def grade(self, problem: Problem, response: str) -> tuple[float, dict]:
        return grade_integer_answer(response, problem.answer)

    @property
    def train_size(self) -> int:
        return len(self._train)
