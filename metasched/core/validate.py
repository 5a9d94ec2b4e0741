"""Checks of the fields of a recorded trace's lines (:mod:`metasched.sim.trace`), which
fail with a one-line :class:`~metasched.errors.ConfigError` naming the file, the line and
the field, e.g. ``run.jsonl:12: actions[3].timeout_s: must be > 0 (got -1)``.

A trace is recorded data, not a setting: its parser reads it field by field, naming a
field only when one fails. Configs, profiles and requests are pydantic schemas
(:mod:`metasched.core.schema`)."""

from __future__ import annotations

import math
from typing import Any

from metasched.errors import ConfigError, short

# ---------------------------------------------------------------- JSON fields


class Field:
    """Where a value sits: ``file:line`` and the field path within the line.

    The path is joined only when an error names it: parsers make a locator for every
    field they read (a trace of a million lines reads tens of millions), and nearly
    none of them is ever printed.
    """

    __slots__ = ("loc", "_parent", "_key")

    def __init__(self, loc: str, path: str = "", *, _parent: Field | None = None) -> None:
        self.loc = loc
        self._parent = _parent
        self._key = path

    @property
    def path(self) -> str:
        parent = self._parent
        if parent is None:
            return self._key
        head, key = parent.path, self._key
        sep = "." if head and not key.startswith("[") else ""
        return f"{head}{sep}{key}"

    def __getitem__(self, key: str) -> Field:
        return Field(self.loc, key, _parent=self)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Field) and (self.loc, self.path) == (other.loc, other.path))

    def __hash__(self) -> int:
        return hash((self.loc, self.path))

    def __repr__(self) -> str:
        return f"Field(loc={self.loc!r}, path={self.path!r})"

    def __str__(self) -> str:
        path = self.path
        return f"{self.loc}: {path}" if path else self.loc


def number(value: Any, at: Field, *, lo: float = -math.inf, hi: float = math.inf,
           lo_open: bool = False, integer: bool = False) -> Any:
    """``value`` as a finite number within the bounds (an int if ``integer``), or an
    error naming ``at``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(str(at), f"must be a number (got {short(value)})")
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        v = math.inf
    if not math.isfinite(v):
        raise ConfigError(str(at), f"must be a finite number (got {short(value)})")
    if integer and v != int(v):
        raise ConfigError(str(at), f"must be a whole number (got {short(value)})")
    if (lo_open and v <= lo) or (not lo_open and v < lo) or v > hi:
        bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
        if hi < math.inf:
            bound += f" and <= {hi:g}"
        raise ConfigError(str(at), f"must be {bound} (got {short(value)})")
    return int(v) if integer else v


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
