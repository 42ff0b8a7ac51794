"""Which model names the server answers to.

The backend serves one or more models under their own names (`model.name_or_path`); clients ask
for models by the names their recipes know (`Qwen/Qwen3-4B-Instruct-2507`). `serve.model_aliases`
maps the latter to the former. `get_server_capabilities` advertises both, and any other name is a
user error that lists the names that work.
"""

from __future__ import annotations

from meshrl.api.errors import UserError
from meshrl.api.types import SupportedModel
from meshrl.config.base import ConfigError


class ModelCatalogue:
    """Served models and their aliases."""

    def __init__(self, served: list[SupportedModel], aliases: dict[str, str | None],
                 max_context_length: int | None):
        if not served:
            raise ConfigError("serve: the backend serves no models")
        self._served = {m.model_name: m for m in served}
        self._aliases: dict[str, str] = {}
        for alias, target in aliases.items():
            if target is None:
                if len(served) != 1:
                    raise ConfigError(f"serve.model_aliases.{alias}: null means the one served model, but the "
                                      f"backend serves {len(served)}: name one of {sorted(self._served)}")
                target = served[0].model_name
            if target not in self._served:
                raise ConfigError(f"serve.model_aliases.{alias}: {target!r} is not served "
                                  f"(the backend serves {sorted(self._served)})")
            self._aliases[alias] = target
        self._max_context_length = max_context_length

    def resolve(self, name: str) -> str:
        """The served model a client's model name stands for; UserError for an unknown name."""
        if name in self._served:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise UserError(f"unknown base_model {name!r}: this server serves {sorted(self._served)}"
                        + (f" and answers to {sorted(self._aliases)}" if self._aliases else ""))

    def capabilities(self) -> list[dict]:
        """`supported_models` of `get_server_capabilities`: every served model and alias."""
        names = [*self._served, *self._aliases]
        return [{"model_name": name, "max_context_length": self._context_length(name),
                 "trainable": True, "sampleable": True} for name in names]

    def _context_length(self, name: str) -> int:
        """The context length advertised for a served model or alias."""
        if self._max_context_length is not None:
            return self._max_context_length
        return self._served[self.resolve(name)].max_context_length
