"""The one-line refusal of a config value, and the small predicates the checks are written with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration value that is not allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={as_typed(value)} is not allowed: {allowed}")


def as_typed(value: Any) -> str:
    """A config value as a refusal line shows it: true/false/null as typed on the command line (YAML), strings
    quoted (so ``'1'``, a string, reads apart from ``1``), everything else as Python writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def check(cfg: DictConfig, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    """Raise ``ConfigError(key, value, allowed)`` unless ``ok(value)`` for the value at ``key``."""
    value = OmegaConf.select(cfg, key)
    if not ok(value):
        raise ConfigError(key, value, allowed)


def at_least(minimum: float) -> Callable[[Any], bool]:
    """A predicate: set and at least ``minimum``."""
    return lambda value: _number(value) and value >= minimum


def positive(value: Any) -> bool:
    """Set and greater than zero."""
    return _number(value) and value > 0


def _number(value: Any) -> bool:
    # Keys of an untyped (user's) model config may hold any text: compare numbers only.
    return isinstance(value, int | float) and not isinstance(value, bool)
