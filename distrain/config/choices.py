"""Closed sets of string options for the config schemas."""

from __future__ import annotations

import sys
from enum import Enum


class Choice(str, Enum):
    """A string option with a closed set of values: Hydra refuses any other value at composition, listing the
    allowed ones. Members are their own names and compare, hash and print as the plain string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))


def choices(name: str, *values: str) -> type[Choice]:
    """A Choice enum named ``name``, attributed to the calling module (where it is defined, so it pickles)."""
    return Choice(name, {value: value for value in values}, module=sys._getframe(1).f_globals["__name__"])
