"""Typed configuration for every meshrl component (see ``base`` for loading rules)."""

from meshrl.config.base import ConfigError, Section, load_config, to_yaml

__all__ = ["ConfigError", "Section", "load_config", "to_yaml"]
