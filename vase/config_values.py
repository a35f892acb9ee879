"""Settings' values as their fields' types, read once where they come in.

A setting is a bool, an int, a float, a string or a list of one of those. Values come in two forms:
JSON values (config.json, presets, schedules), where a list is a JSON list; and text typed on the
command line (``--set section.field=value``, and the options that stand for such settings), where
a list is written comma-separated (``--set model.channels=64,64,128,128``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, get_args, get_origin, get_type_hints

from vase.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# How a list's items are named in an error message.
_ITEMS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def comma_list(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c']: a list as it is typed on the command line (empty items dropped)."""
    return [part.strip() for part in str(text).split(",") if part.strip()]


def _scalar(typ: Any, value: Any) -> Any:
    if typ is bool:
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise ValueError(value)
        return bool(value)
    if typ is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if typ in (float, str):
        return typ(value)
    return value


def _item_type(typ: Any) -> Any | None:
    """list[int] -> int; None for a setting that is not a list."""
    return get_args(typ)[0] if get_origin(typ) is list else None


def coerce(typ: Any, value: Any, name: str) -> Any:
    """A JSON value as the type `typ` of the setting `name`; a ConfigError saying why it cannot be."""
    item = _item_type(typ)
    if item is not None:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list of {_ITEMS[item]}, got {value!r}")
        try:
            return [_scalar(item, v) for v in value]
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a list of {_ITEMS[item]}, got {value!r}") from None
    try:
        return _scalar(typ, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {typ.__name__}") from None


def from_text(typ: Any, text: str, name: str) -> Any:
    """Command-line text as the type `typ` of the setting `name` (a list from its comma form)."""
    item = _item_type(typ)
    if item is None:
        return coerce(typ, text, name)
    try:
        return coerce(typ, comma_list(text), name)
    except ConfigError:
        raise ConfigError(f"{name} must be a comma-separated list of {_ITEMS[item]}, got {text!r}") from None


def set_field(section: Any, key: str, value: Any, name: str, text: bool = False) -> None:
    """Set one field of a config section from a JSON value, or from command-line text if `text`."""
    types = get_type_hints(type(section))
    if key not in types:
        raise ConfigError(f"unknown setting {name!r}; known fields: {', '.join(sorted(types))}")
    setattr(section, key, (from_text if text else coerce)(types[key], value, name))


def assign(cfg: Any, assignment: str) -> None:
    """Apply one ``section.field=value`` from the command line to the sections of `cfg`."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    path, value = assignment.split("=", 1)
    parts = path.strip().split(".")
    sections = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(f"unknown setting {path!r}; settings are section.field with sections {', '.join(sections)}")
    set_field(getattr(cfg, parts[0]), parts[1], value, path, text=True)
