"""Which trajectory an HTTP request's actions belong to: from optional headers
(``X-Trajectory-Id``, ``X-Turn``, ``X-Task``, ``X-Reward``) or the same fields in the
JSON body (``trajectory``, ``turn``, ``task``, ``reward``; the body wins). Without
them, a request is a trajectory of its own.

Frameworks that speak SandboxFusion's contract send neither, and get one trajectory per
request; a rollout worker that wants the scheduler to see its trajectories (their
turns, their reward action, a workspace kept across its tool calls) adds the headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metasched.errors import ConfigError

__all__ = ["HEADERS", "TrajectoryContext", "context_from"]

# Header -> the request field it fills.
HEADERS = {"x-trajectory-id": "trajectory", "x-turn": "turn", "x-task": "task",
           "x-reward": "reward"}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


@dataclass(frozen=True)
class TrajectoryContext:
    """The trajectory fields of one HTTP request (None: not given)."""

    trajectory: str | None = None
    turn: int | None = None
    task: str | None = None
    reward: bool | None = None

    def fields(self) -> dict[str, Any]:
        """The given fields, as request fields."""
        return {k: v for k, v in (("trajectory", self.trajectory), ("turn", self.turn),
                                  ("task", self.task), ("reward", self.reward))
                if v is not None}


def _header_value(field: str, header: str, text: str) -> Any:
    text = text.strip()
    if field == "turn":
        if not text.isdigit():
            raise ConfigError(header, f"must be a whole number >= 0 (got {text!r})")
        return int(text)
    if field == "reward":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(header, f"must be true or false (got {text!r})")
    if not text:
        raise ConfigError(header, "must not be empty")
    return text


def context_from(headers: Mapping[str, str]) -> TrajectoryContext:
    """The trajectory context given by a request's headers (``headers`` looked up by
    lower-case name, as Starlette's are). The body's fields of the same meaning, where
    given, override it: the caller merges them.

    Raises:
        ConfigError: a header with a bad value, named (``X-Turn: must be ...``).
    """
    given: dict[str, Any] = {}
    for header, field in HEADERS.items():
        value = headers.get(header)
        if value is not None:
            name = "-".join(p.capitalize() for p in header.split("-"))
            given[field] = _header_value(field, name, value)
    return TrajectoryContext(**given)
