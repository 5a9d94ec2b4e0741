"""When an HTTP caller stops waiting: the deadline the service gives the dispatcher
with each request (``deadline_s``, see :mod:`metasched.runtime.dispatch.sharing`).

In order:

1. The header ``X-Metasched-Deadline-S``: seconds from the request's receipt (a
   number > 0), on ``/run_code`` and ``POST /v1/actions``. On ``/v1/actions`` the
   body's ``deadline_s`` wins over it.
2. The contract the caller speaks. ``/run_code``: SandboxFusion's clients wait for
   their timeouts plus a margin of their own: verl's (and SkyRL's copy of it) sends
   ``compile_timeout`` and ``run_timeout`` and waits ``compile_timeout + run_timeout +
   10`` s (its ``API_TIMEOUT``) before its read times out; SkyRL's coder client sends
   ``run_timeout`` alone and waits ``run_timeout + 2`` s. So a request with
   ``compile_timeout`` gets ``compile + run + 10`` (a timeout not given counts as the
   service's ``limits.timeout_s``), one with ``run_timeout`` alone ``run + 2``.
   The native API's Python client sends its ``wait_s`` as ``deadline_s``.
3. Otherwise the dispatcher's ``deadlines.default_s`` (None: no deadline).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from metasched.errors import ConfigError, short

__all__ = ["DEADLINE_HEADER", "DEADLINE_PARAM", "REFUSED_504", "SANDBOX_FUSION_MARGIN_S",
           "SKYRL_RUN_ONLY_MARGIN_S", "header_deadline", "run_code_deadline"]

DEADLINE_HEADER = "X-Metasched-Deadline-S"
SANDBOX_FUSION_MARGIN_S = 10.0  # verl's API_TIMEOUT, beyond compile + run timeouts
SKYRL_RUN_ONLY_MARGIN_S = 2.0  # SkyRL's coder client: run_timeout + 2
_MAX_S = 30 * 24 * 3600.0

# The header, as an OpenAPI parameter.
DEADLINE_PARAM = {
    "name": DEADLINE_HEADER, "in": "header", "required": False,
    "description": "seconds from receipt after which the caller stops waiting",
    "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": _MAX_S}}
# /run_code's 504 (deadlines.on_deadline: refuse).
REFUSED_504 = {"description": "the request could not start before its caller's deadline "
               "(deadlines.on_deadline: refuse): retry it"}


def header_deadline(headers: Mapping[str, str]) -> float | None:
    """The deadline the header gives (None: no header).

    Raises:
        ConfigError: a value that is not a number of seconds in (0, 30 days].
    """
    text = headers.get(DEADLINE_HEADER.lower())
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= _MAX_S:
        raise ConfigError(DEADLINE_HEADER, f"must be a number of seconds > 0 and <= "
                          f"{_MAX_S:.0f} (got {short(text)})")
    return value


def run_code_deadline(compile_timeout: float | None, run_timeout: float | None,
                      default_timeout_s: float) -> float | None:
    """How long a ``/run_code`` caller waits, from the fields it sent (see the module
    docstring; None: the fields say nothing)."""
    if compile_timeout is not None:
        run = default_timeout_s if run_timeout is None else run_timeout
        return compile_timeout + run + SANDBOX_FUSION_MARGIN_S
    if run_timeout is not None:
        return run_timeout + SKYRL_RUN_ONLY_MARGIN_S
    return None
