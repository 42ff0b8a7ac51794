"""Plugins: the modules a run names in `plugins`, imported in the controller and in every learner
process before anything else, so that the losses and loss terms they register can be named in the
config (`trainer.loss.name`, `trainer.terms`)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class PluginError(ImportError):
    """A plugin could not be imported; the message names it and the cause, in one line."""


def _from_file(path: Path) -> ModuleType:
    """The module at ``path``, imported once per process (under a name derived from its path)."""
    resolved = path.resolve()
    name = f"meshrl_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise PluginError(f"plugins: no file {path}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_plugins(entries: list[str]) -> list[ModuleType]:
    """Import every entry: a dotted module name (`pkg.module`) or the path of a Python file
    (`path/to/file.py`). Each is imported once per process; PluginError names the first that fails."""
    modules = []
    for entry in entries:
        try:
            modules.append(_from_file(Path(entry)) if entry.endswith(".py") else importlib.import_module(entry))
        except PluginError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the plugin's own code, in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise PluginError(f"plugins: cannot import {entry!r}: {type(e).__name__}: {first}") from None
    return modules
