"""Which trajectory an HTTP request's actions belong to: from optional headers
(``X-Trajectory-Id``, ``X-Turn``, ``X-Task``, ``X-Reward``, ``X-Prompt-Id``) or the same
fields in the JSON body (``trajectory``, ``turn``, ``task``, ``reward``, ``prompt``; the
body wins). Without them, a request is a trajectory of its own. ``X-Prompt-Id`` names
the prompt the trajectory answers (GRPO's responses to one prompt share it: the
scheduler's remaining-work predictor reads the siblings).

Frameworks that speak SandboxFusion's contract send neither, and get one trajectory per
request; a rollout worker that wants the scheduler to see its trajectories (their
turns, their reward action, a workspace kept across its tool calls) adds the headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from metasched.core.schema import MAX_KEY
from metasched.errors import validation_error
from metasched.runtime.requests import MAX_TURN

__all__ = ["HEADERS", "TrajectoryContext", "context_from"]

# Header -> the request field it fills.
HEADERS = {"x-trajectory-id": "trajectory", "x-turn": "turn", "x-task": "task",
           "x-reward": "reward", "x-prompt-id": "prompt"}
_Header = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1,
                                          max_length=MAX_KEY)]


class TrajectoryContext(BaseModel):
    """The trajectory fields of one HTTP request (None: not given), validated from the
    headers' text: ``X-Turn`` a whole number, ``X-Reward`` true or false (``1``,
    ``yes`` ... as pydantic reads a boolean); the request schema checks them again as
    request fields once merged."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    trajectory: _Header | None = Field(None, alias="X-Trajectory-Id")
    turn: Annotated[int, Field(ge=0, le=MAX_TURN)] | None = Field(None, alias="X-Turn")
    task: _Header | None = Field(None, alias="X-Task")
    reward: bool | None = Field(None, alias="X-Reward")
    prompt: _Header | None = Field(None, alias="X-Prompt-Id")

    def fields(self) -> dict[str, Any]:
        """The given fields, as request fields."""
        return self.model_dump(exclude_none=True)


def context_from(headers: Mapping[str, str]) -> TrajectoryContext:
    """The trajectory context given by a request's headers (``headers`` looked up by
    lower-case name, as Starlette's are). The body's fields of the same meaning, where
    given, override it: the caller merges them.

    Raises:
        ConfigError: a header with a bad value, named (``X-Turn: must be ...``).
    """
    given = {"-".join(p.capitalize() for p in header.split("-")): headers[header]
             for header in HEADERS if headers.get(header) is not None}
    if not given:
        return _NONE
    try:
        return TrajectoryContext.model_validate(given)
    except ValidationError as e:
        raise validation_error(e.errors(), model=TrajectoryContext) from None


_NONE = TrajectoryContext()
