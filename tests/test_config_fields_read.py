"""Every documented setting is read by code: a field of any config section that no module outside
`meshrl/config/` mentions (as an attribute or a key), and that no config method called from
outside reads, is a setting that does nothing. Validators do not count as readers."""

import ast
import inspect
import re
import textwrap
from pathlib import Path

from pydantic import BaseModel, model_validator

from meshrl.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[1] / "meshrl"


def _sections(cls: type[BaseModel], seen: dict) -> dict:
    """Every config section class reachable from ``cls`` (nested sections, lists and dicts of them)."""
    seen[cls.__name__] = cls
    for field in cls.model_fields.values():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                if t.__name__ not in seen:
                    _sections(t, seen)
            else:
                stack.extend(getattr(t, "__args__", ()))
    return seen


def _code_outside_config() -> str:
    return "\n".join(p.read_text() for p in ROOT.rglob("*.py") if "config" not in p.relative_to(ROOT).parts[:1])


def _read_by_called_methods(cls: type, code: str) -> set[str]:
    """Fields that methods of ``cls`` read as ``self.field``, for methods that code outside the
    config package calls (pydantic validators excluded)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    read = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or not re.search(rf"\.{node.name}\(", code):
            continue
        if any("validator" in ast.unparse(d) for d in node.decorator_list):
            continue
        read |= {n.attr for n in ast.walk(node)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return read


def unread_fields(root: type[BaseModel], code: str) -> list[str]:
    unread = []
    for name, cls in sorted(_sections(root, {}).items()):
        via_methods = _read_by_called_methods(cls, code)
        for field in cls.model_fields:
            if field not in via_methods and not re.search(rf"\.{field}\b|[\"']{field}[\"']", code):
                unread.append(f"{name}.{field}")
    return unread


def test_every_config_field_is_read_outside_the_config_package():
    unread = unread_fields(RunConfig, _code_outside_config())
    assert not unread, f"config fields no code reads: {unread}"


class Probe(RunConfig):
    never_read_xyz: int = 0
    read_by_method_xyz: int = 0
    read_by_validator_xyz: int = 0

    def probe_value_xyz(self) -> int:
        return self.read_by_method_xyz

    @model_validator(mode="after")
    def _check_xyz(self) -> "Probe":
        assert self.read_by_validator_xyz >= 0
        return self


def test_the_check_reports_unread_fields_and_accepts_called_methods():
    code = _code_outside_config() + "\nx = cfg.probe_value_xyz()\n"
    unread = unread_fields(Probe, code)
    assert "Probe.never_read_xyz" in unread and "Probe.read_by_validator_xyz" in unread
    assert "Probe.read_by_method_xyz" not in unread
    assert not [f for f in unread if not f.startswith("Probe.")]
