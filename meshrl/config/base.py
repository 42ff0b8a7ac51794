"""Typed configuration: the base class every component config derives from, YAML loading,
dotted command-line overrides, and one-line error messages.

Every config section is a pydantic model that forbids unknown keys and documents each field with
the docstring written under it (``use_attribute_docstrings``), so ``meshrl train --dry-run`` and the
generated reference can show what each field means.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the key path."""


def _describe_value(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """Turn the first pydantic error into a single line: key path, bad value, what was expected."""
    first = err.errors()[0]
    path = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown key '{path}'"
    if kind == "missing":
        return f"{source}: missing required key '{path}'"
    value = first.get("input")
    expected = first["msg"]
    if kind == "value_error" and isinstance(value, dict):
        # a cross-field check on a whole section: the message already names the fields
        return f"{source}: {path}: {expected.removeprefix('Value error, ')}"
    for prefix in ("Input should be ", "Value error, "):
        if expected.startswith(prefix):
            expected = expected[len(prefix):]
    return f"{source}: {path} = {_describe_value(value)}: expected {expected}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into the key path and a YAML-parsed value (so ``1e-5`` is a float,
    ``true`` a bool, ``[1,2]`` a list and anything else a string)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': empty key segment in '{key}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted overrides to a nested dict in place and return it."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                dotted = ".".join(path[: i + 1])
                raise ConfigError(f"override '{item}': '{dotted}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with one-line errors for a missing file, bad YAML or a non-mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build a typed config from an optional YAML file plus dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path) if path else "config")) from None


def to_yaml(cfg: BaseModel) -> str:
    """The fully resolved config as YAML (what ``--dry-run`` prints and runs save)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def describe_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field, recursing into sections."""
    rows: list[tuple[str, str, str]] = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, key + "."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append((key, repr(default), (field.description or "").strip()))
        # an optional section (`X | None`): its own fields too
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            rows.extend(row for arg in typing.get_args(ann) if isinstance(arg, type) and issubclass(arg, BaseModel)
                        for row in describe_fields(arg, key + "."))
    return rows
