"""What ``/openapi.json`` says the routes answer: the shared one-line error
(:class:`ErrorDetail`, ``{"detail": "<field>: <problem>"}``, for every 4xx and 5xx the
service itself makes, FastAPI's validation errors included), the native API's bodies,
and :func:`responses`, which each route declares its answers with.

Every route may also be answered by what runs before it: 401 (a missing or wrong bearer
token, when the service has one; not ``/v1/ping`` and ``/v1/health``), 408 (headers or
body too slow: ``header_timeout_s``, ``body_timeout_s``), 413 (a body over
``max_body_mb``) and 503 (``max_connections`` open already).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from metasched.runtime.requests import MAX_TURN

__all__ = ["GATED", "OPEN", "TRAJECTORY_HEADERS", "ActionPending", "CancelAnswer",
           "ErrorDetail", "Health",
           "TrajectoryClosing", "responses"]


class ErrorDetail(BaseModel):
    """A one-line error answer."""

    detail: str = Field(description="<field>: <problem>, on one line")


class ActionPending(BaseModel):
    """A request accepted (journaled) that has not finished yet."""

    id: str
    status: Literal["queued", "running"]


class CancelAnswer(BaseModel):
    """What a cancel did."""

    id: str
    status: Literal["cancelled", "cancelling", "finished", "running"] = Field(
        description="cancelled: it ended now, never having run; cancelling: its command "
        "is being killed (its result, status cancelled, follows); finished: it had ended "
        "(nothing done); running: an api call or gpu service batch, which runs to its end")


class Health(BaseModel):
    """Liveness and readiness."""

    status: Literal["ok", "starting"]
    scheduler: str | None = Field(None, description="the policy in use, once ready")


class TrajectoryClosing(BaseModel):
    """A trajectory whose sandbox and workspace go once nothing of it is left."""

    trajectory: str
    status: Literal["closing"]


_WHY = {
    400: "a bad request line (a proxied path that leaves the endpoint's base path)",
    401: "a missing or wrong bearer token (when the service has one)",
    403: "another client's trajectory or action (with authentication on, only the "
         "client that opened a trajectory may act on it)",
    404: "not known here",
    408: "the request's headers or body did not arrive in time (header_timeout_s, "
         "body_timeout_s); the connection is closed",
    413: "a request body over max_body_mb",
    422: "a request that is not valid here: one line naming the field",
    502: "the upstream could not be reached",
    503: "max_connections connections are open already; this one is closed",
    504: "the upstream call ran past the endpoint's timeout_s",
}
OPEN = (408, 413, 503)  # what may answer any request before its route
GATED = (401, *OPEN)  # ... and, but for /v1/ping and /v1/health, the token check


def responses(*codes: int, **models: Any) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: each of ``codes`` an :class:`ErrorDetail`
    (with its usual description), and ``models`` (``s422=Model``) a model of their
    own for that status code."""
    out: dict[int | str, dict[str, Any]] = {
        c: {"model": ErrorDetail, "description": _WHY[c]} for c in codes}
    for key, model in models.items():
        code = int(key.removeprefix("s"))
        out[code] = {**out.get(code, {"description": _WHY.get(code, "")}), "model": model}
    return out


# The trajectory headers (see metasched.serve.context), as OpenAPI parameters.
TRAJECTORY_HEADERS: list[dict[str, Any]] = [
    {"name": "X-Trajectory-Id", "in": "header", "required": False,
     "description": "the trajectory this request's actions belong to",
     "schema": {"type": "string", "minLength": 1}},
    {"name": "X-Turn", "in": "header", "required": False, "description": "its turn",
     "schema": {"type": "integer", "minimum": 0, "maximum": MAX_TURN}},
    {"name": "X-Task", "in": "header", "required": False, "description": "its task",
     "schema": {"type": "string", "minLength": 1}},
    {"name": "X-Reward", "in": "header", "required": False,
     "description": "whether this is its reward action", "schema": {"type": "boolean"}},
    {"name": "X-Prompt-Id", "in": "header", "required": False,
     "description": "the prompt its trajectory answers (GRPO's responses to one prompt "
     "share it)", "schema": {"type": "string", "minLength": 1}},
]
