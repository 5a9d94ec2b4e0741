"""Readers of user-written JSON fields (trace lines, dispatcher requests) that fail
with a one-line :class:`~metasched.errors.ConfigError` naming the file, line and field,
e.g. ``jobs.jsonl:12: timeout_s: must be > 0 (got -1)``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from metasched.config import _num
from metasched.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Field:
    """Where a value sits: ``file:line`` and the field path within the line."""

    loc: str
    path: str = ""

    def __getitem__(self, key: str) -> Field:
        sep = "." if self.path and not key.startswith("[") else ""
        return Field(self.loc, f"{self.path}{sep}{key}")

    def __str__(self) -> str:
        return f"{self.loc}: {self.path}" if self.path else self.loc


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (keeps error messages short)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def number(value: Any, at: Field, **bounds: Any) -> Any:
    """``config._num`` plus the checks it leaves out: finite values only, no giant ints."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(str(at), f"must be a number (got {short(value)})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ConfigError(str(at), f"must be a finite number (got {short(value)})")
    return _num(value, at, **bounds)


def string(value: Any, at: Field) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(str(at), f"must be a non-empty string (got {short(value)})")
    return value


def json_object(value: Any, at: Field, allowed: set[str]) -> dict[str, Any]:
    """``value`` as a JSON object with no keys outside ``allowed``."""
    if not isinstance(value, dict):
        raise ConfigError(str(at), f"must be a JSON object (got {short(value)})")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(str(at[unknown[0]]),
                          f"unknown field (expected one of: {', '.join(sorted(allowed))})")
    return value


def required(d: dict[str, Any], key: str, at: Field) -> Any:
    if key not in d:
        raise ConfigError(str(at[key]), "is required")
    return d[key]


__all__ = ["Field", "json_object", "number", "required", "short", "string"]
