"""Command-line overrides that Hydra cannot compose, refused in one line instead of Hydra's page.

Hydra reports a composition error (a misspelt key, a value of the wrong type, a value outside an enum, a group
option that does not exist) as several lines and exits 1. When Hydra fails (``distrain.launch.entry.compose_and_run``)
``composition_error`` composes the same overrides again and turns the first such error into the line distrain
prints for every config mistake: the key, the value, and what is allowed (train.py then exits 2).
``added_key_error`` refuses a ``+key=value`` that composes but that no schema reads.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distrain.config.checks import as_typed
from distrain.config.schema import SCHEMAS, register_configs

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def plain_overrides(argv: list[str]) -> list[str] | None:
    """The ``key=value`` overrides of a single run (None for a multirun, a Hydra flag or a Hydra setting, which
    Hydra handles itself)."""
    if any(arg.startswith("-") for arg in argv):
        return None
    return [arg for arg in argv if not arg.lstrip("+~").startswith(("hydra.", "hydra/"))]


def quote_group_options(argv: list[str], config_dir: Path = CONF_DIR) -> list[str]:
    """``debug=nan`` -> ``debug='nan'``: Hydra reads an unquoted ``nan``, ``inf``, number or boolean as that value,
    and a config group's option must be a name (``conf/debug/nan.yaml``), so such options are quoted, also in a
    sweep (``debug=nan,fast``), a list (``logger=[wandb,1]``) and with ``+``, ``++``, ``~`` or ``@package``."""
    groups = {path.name for path in config_dir.iterdir() if path.is_dir()}
    quoted = []
    for arg in argv:
        key, equals, value = arg.partition("=")
        group = key.lstrip("+~").partition("@")[0]
        if equals and group in groups and "(" not in value:
            listed = value.startswith("[") and value.endswith("]")
            options = (value[1:-1] if listed else value).split(",")
            options = [f"'{option}'" if _hydra_reads_as_non_string(option) else option for option in options]
            arg = f"{key}={'[' if listed else ''}{','.join(options)}{']' if listed else ''}"
        quoted.append(arg)
    return quoted


def _as_typed(value: str) -> str:
    """An override's value as a refusal shows it: as Hydra reads it, shown like every refusal's value
    (``distrain.config.checks.as_typed``: ``2``, ``true``, ``null``, ``'abc'``)."""
    return as_typed(_hydra_value(value))


def _hydra_value(value: str) -> Any:
    """What Hydra reads an override's ``value`` as (a number, bool, None, list, or a string; the text itself when
    it does not parse)."""
    try:
        return OverridesParser.create().parse_overrides([f"key={value}"])[0].value()
    except (OverrideParseException, ValueError):
        return value


def _hydra_reads_as_non_string(value: str) -> bool:
    return not isinstance(_hydra_value(value), str)


def composition_error(overrides: list[str], config_dir: Path = CONF_DIR) -> str | None:
    """Why Hydra cannot compose ``overrides`` (``key=value is not allowed: ...``), or None when it can."""
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except MissingConfigException as err:  # an option that is not in its group
        missing = re.search(r"Could not (?:find|load) '([^']+)'", str(err))
        group, _, option = (missing[1] if missing else "?").rpartition("/")
        options = sorted(path.stem for path in (config_dir / group).glob("*.yaml")) if group else []
        return f"{group}={option!r} is not allowed: one of {', '.join(options)}"
    except (ConfigCompositionException, OverrideParseException) as err:
        cause = err.__cause__
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            value = _override_value(overrides, cause.full_key)
            reason = str(cause).splitlines()[0]
            schema = getattr(cause, "object_type", None)
            reason = _what_is_allowed(reason, schema, getattr(cause, "key", None))
            if "not in" in reason:
                known = _one_of(schema) if schema is not None and dataclasses.is_dataclass(schema) else reason
                hint = _other_options(cause.full_key, config_dir)
                reason = _tracker_hint(cause.full_key) or f"no such key ({known}){hint}"
            return f"{cause.full_key}={_as_typed(value)} is not allowed: {reason}"
        return " ".join(str(err).split())
    except (ValueError, TypeError) as err:  # Hydra's own type errors (a group option that is not a name)
        return " ".join(str(err).split())
    return added_key_error(cfg, overrides, config_dir)


def _what_is_allowed(reason: str, schema: type | None, name: object) -> str:
    """OmegaConf's message for a value of the wrong type, said as what the key takes ("an integer", "one of ...")."""
    listed = re.search(r"expected one of \[(.*)\]", reason)
    if listed:
        return f"one of {listed[1]}"
    if "is not a ListConfig" in reason:
        return "a list, e.g. [a,b]"
    if "is not Optional" in reason:
        return f"{_type_in_words(schema, name)}, not null"
    for phrase, words in (("to Integer", "an integer"), ("to Float", "a number"), ("valid bool", "true or false")):
        if phrase in reason:
            return words
    return reason


def _type_in_words(schema: type | None, name: object) -> str:
    """The schema's type of field ``name`` as a refusal says it (e.g. "an integer"), or "a value"."""
    if schema is None or not dataclasses.is_dataclass(schema) or not isinstance(name, str):
        return "a value"
    kind = typing.get_type_hints(schema).get(name)
    if typing.get_origin(kind) in (list, tuple):
        return "a list"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return f"one of {', '.join(member.name for member in kind)}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(kind, "a value")  # type: ignore[arg-type]


def _other_options(full_key: str, config_dir: Path) -> str:
    """``; it is a key of parallelism=fsdp, hsdp, ...`` when ``group.key`` belongs to other options of the group
    (``parallelism.tp`` under ``parallelism=ddp``); empty otherwise."""
    group, _, key = full_key.partition(".")
    if group not in SCHEMAS or "." in key:
        return ""
    owners = []
    for option in sorted((config_dir / group).glob("*.yaml")):
        schema = re.search(rf"/schema/{group}/(\w+)@(_here_|{group})\b", option.read_text())
        if schema and key in _fields(SCHEMAS[group].get(schema[1], object)):
            owners.append(option.stem)
    return f"; it is a key of {group}={', '.join(owners)}" if owners else ""


def _tracker_hint(full_key: str) -> str | None:
    """A ``logger.*`` key that is not there: each tracker's keys sit under its name, a tracker's key only exists
    when it is selected, and a new tag is added with ``+``."""
    parts = full_key.split(".")
    trackers = SCHEMAS["logger"]
    if parts[0] != "logger" or len(parts) < 2:
        return None
    if len(parts) == 2 and parts[1] in trackers:
        return f"logger.{parts[1]} is not selected; select it with logger={parts[1]} or logger=[{parts[1]},...]"
    if len(parts) == 2:
        owners = [f"logger.{name}.{parts[1]}" for name, schema in trackers.items() if parts[1] in _fields(schema)]
        return f"each tracker's keys sit under its name: {' or '.join(owners) or 'logger.<tracker>.<key>'}"
    if len(parts) == 4 and parts[2] == "tags":
        return f"a new tag is added with a plus: +{full_key}=<value>"
    return None


def added_key_error(cfg: DictConfig, overrides: list[str], config_dir: Path = CONF_DIR) -> str | None:
    """``+key=value`` adds a key Hydra's struct mode would refuse; under a typed schema nothing would read it (or
    the component it builds would fail on it in every rank), so it is refused like a misspelt key."""
    for override in overrides:
        if not override.startswith("+"):
            continue
        key, _, value = override.lstrip("+").partition("=")
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
        if schema is not None and dataclasses.is_dataclass(schema):
            if name not in _fields(schema):
                where = parent_key or "the config"
                hint = _other_options(key, config_dir)
                return f"{key}={_as_typed(value)} is not allowed: no such key in {where} ({_one_of(schema)}){hint}"
    return None


def _fields(schema: type) -> list[str]:
    if not dataclasses.is_dataclass(schema):
        return []
    return [field.name for field in dataclasses.fields(schema) if not field.name.startswith("_")]


def _one_of(schema: type) -> str:
    return f"one of {', '.join(_fields(schema))}"


def _override_value(overrides: list[str], key: str) -> str:
    for override in reversed(overrides):
        name, _, value = override.lstrip("+~").partition("=")
        if name == key or name.startswith(key + "."):
            return value
    return "?"
