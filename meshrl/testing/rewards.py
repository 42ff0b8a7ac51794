"""Toy verifiers for exercising the runtime with models that cannot solve the real task yet
(e.g. the random tiny model): they give rewards that vary between samples, or fail on purpose."""

from __future__ import annotations

VOWELS = set("aeiouAEIOU")


def vowel_fraction(problem, response: str) -> tuple[float, dict]:
    """Reward = fraction of the response's characters that are vowels (varies for any model)."""
    text = response or ""
    frac = sum(ch in VOWELS for ch in text) / max(len(text), 1)
    return frac, {"correct": frac > 0.5}


def fails_on_odd_length(problem, response: str) -> tuple[float, dict]:
    """Raises for responses of odd length (a grader bug), else the vowel fraction."""
    if len(response or "") % 2:
        raise RuntimeError("grader bug: odd length")
    return vowel_fraction(problem, response)
