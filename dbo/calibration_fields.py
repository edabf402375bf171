"""What a calibration file's fields must be (`dbo.calibration`): finite numbers in range,
counts as ints, text as strings, and the keys of each dataclass; errors name the field
by its place in the file (`points[3].tokens=...`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["FieldError", "MAX_INT", "as_number", "build_checked", "check_int", "check_keys",
           "check_str", "finite_positive", "in_range", "show"]

MAX_INT = 2 ** 53
"""Counts above this are refused: no float holds them exactly, and no step has as many."""


def as_number(value: object) -> float | None:
    """`value` as a float where it is a finite int or float (not a bool), else None (an
    int too large for a float, e.g. 10**400 read from JSON, included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except OverflowError:
        return None
    return result if math.isfinite(result) else None


def finite_positive(value: object) -> bool:
    number = as_number(value)
    return number is not None and number > 0.0


def in_range(value: object, low: float, high: float, *, low_open: bool = False,
              high_open: bool = False) -> bool:
    """`value` is a finite number in the range from `low` to `high` (open ends as told)."""
    number = as_number(value)
    if number is None:
        return False
    above = number > low if low_open else number >= low
    below = number < high if high_open else number <= high
    return above and below


def show(value: object, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a file may hold a huge value)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FieldError(ValueError):
    """A bad field value: "<owner>.<field>=<value>: <must>". `Calibration.from_json`
    names the owner by its place in the file instead (e.g. "points[3]")."""

    def __init__(self, owner: str, field_name: str, value: object, must: str) -> None:
        self.field_name, self.value, self.must = field_name, value, must
        super().__init__(self.text(owner))

    def text(self, owner: str) -> str:
        return f"{owner}.{self.field_name}={show(self.value)}: {self.must}"


def check_int(owner: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_INT:
        raise FieldError(owner, name, value, f"must be an int >= {low} (and <= 2**53).")


def check_str(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str):
        raise FieldError(owner, name, value, "must be a string.")



def check_keys(cls: type, data: dict[str, Any], *, where: str) -> None:
    """ValueError naming the keys of `data` that are no field of dataclass `cls`, or the
    fields without a default that it lacks."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown keys {show(unknown)}; known: {sorted(fields)}")
    missing = sorted(name for name, f in fields.items() if name not in data
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")


def build_checked(cls: type, data: dict[str, Any], *, owner: str) -> Any:
    """`cls(**data)`, its errors naming the fields as `owner.<field>`."""
    check_keys(cls, data, where=owner)
    try:
        return cls(**data)
    except FieldError as exc:
        raise ValueError(exc.text(owner)) from None
