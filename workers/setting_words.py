"""How a refused setting is worded: the one place ``load_settings`` turns pydantic's errors
into "invalid settings: ..." problems. A setting's unit is in its name (``_s`` seconds,
``_bytes`` bytes): a value that is no number, or out of bounds, is told in that unit, with
the kind of number expected and, for a round bound, the unit a person reads (366 days)."""

from __future__ import annotations

import re
from typing import Any

# The unit of a setting, by the end of its name.
UNITS = {"s": "seconds", "bytes": "bytes"}
_WHOLE = ("int_parsing", "int_type", "int_from_float")
_NUMBER = ("float_parsing", "float_type", "finite_number")
_BOUNDS = {"greater_than": ("gt", "more than"), "greater_than_equal": ("ge", "at least"),
           "less_than": ("lt", "less than"), "less_than_equal": ("le", "at most")}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)\s*", re.IGNORECASE | re.ASCII)
_DURATION_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"\s*(\d+)\s*(k|m|g)i?b?\s*", re.IGNORECASE | re.ASCII)
_SECONDS_IN = ((86400, "day"), (3600, "hour"), (60, "minute"))
_BYTES_IN = ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB"))


def number(value: object) -> str:
    """A number as a person writes it: 600, not 600.0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def unit_of(field: str) -> str | None:
    return UNITS.get(field.rsplit("_", 1)[-1].lower()) if "_" in field else None


def in_reading_units(bound: object, unit: str | None) -> str:
    """`` (366 days)`` for a bound that is a round number of a larger unit, else ``""``."""
    if not isinstance(bound, int | float) or bound <= 0:
        return ""
    if unit == "seconds":
        for size, name in _SECONDS_IN:
            if bound >= size and bound % size == 0:
                count = int(bound // size)
                return f" ({count} {name}{'s' if count != 1 else ''})"
    if unit == "bytes":
        for size, name in _BYTES_IN:
            if bound >= size and bound % size == 0:
                return f" ({int(bound // size)} {name})"
    return ""


def _written_as(raw: str, unit: str | None, whole: bool) -> str:
    """What to write instead of a value given with a unit of its own ('1h', '1MiB')."""
    if unit == "seconds" and (m := _DURATION.fullmatch(raw)):
        seconds = float(m.group(1)) * _DURATION_S[m.group(2).lower()]
        if not whole or seconds.is_integer():
            return f": write {number(seconds)} (the unit is in the name)"
    if unit == "seconds" and whole and re.fullmatch(r"\s*\d+\.\d*\s*", raw, re.ASCII):
        return ": these seconds are whole (no fraction)"
    if unit == "bytes" and (m := _SIZE.fullmatch(raw)):
        size = int(m.group(1)) * 1024 ** ("kmg".index(m.group(2).lower()) + 1)
        return f": write {size} (the unit is in the name)"
    return ""


def problem(field: str, err: Any) -> str | None:
    """The words for one of pydantic's errors about ``field`` (a settings field name), or
    None for an error this module does not reword (a validator's own message)."""
    kind, given, unit = err["type"], err.get("input"), unit_of(field)
    of_unit = f" of {unit}" if unit else ""
    shown = repr(given) if isinstance(given, str) else number(given)
    if kind in _WHOLE or kind in _NUMBER:
        whole = kind in _WHOLE
        expected = f"a whole number{of_unit}" if whole else f"a number{of_unit}"
        hint = _written_as(given, unit, whole) if isinstance(given, str) else ""
        return f"must be {expected}, got {shown}{hint}"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        bound = err.get("ctx", {}).get(key)
        in_unit = f" {unit}" if unit else ""
        return (f"must be {words} {number(bound)}{in_unit}"
                f"{in_reading_units(bound, unit)}, got {shown.strip(chr(39))}")
    if kind == "bool_parsing":
        return f"must be true or false, got {shown}"
    return None
