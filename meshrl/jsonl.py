"""JSON Lines files of objects: one JSON object per line, blank lines skipped, and a line that is not a
JSON object an error naming ``file:line``."""

from __future__ import annotations

import json
from pathlib import Path


def read_objects(path: str | Path, error: type[Exception] = ValueError) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line of ``path``; ``error`` (one line, naming
    ``path:line``) for a line that is not a JSON object."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: malformed line ({e.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{lineno}: malformed line (a JSON {type(obj).__name__}, not an object)")
            out.append((lineno, obj))
    return out
