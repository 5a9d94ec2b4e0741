"""Limits on HTTP connections that uvicorn lacks: a deadline for a request's headers
and a cap on open connections (:class:`GuardedH11Protocol`).

uvicorn (0.54) times out an idle kept-alive connection (``timeout_keep_alive``), but not
one that never finishes sending its headers: each such client holds a descriptor for
as long as it likes, and some hundreds of them exhaust the process's descriptors, after
which nothing is accepted. Its ``limit_concurrency`` answers a request 503 once there
are too many connections or tasks, which happens only after a request's headers came in,
and keeps the connection open.

Here, a request's headers must be complete within ``header_timeout_s`` of the
connection's opening (or, on a kept-alive connection, of the first byte of the next
request): otherwise the client is answered ``408`` and the connection closed. A
connection beyond ``max_connections`` open at once is answered ``503`` and closed as soon
as it is accepted, so its descriptor is released at once. The request body has its own
deadline (see :class:`~metasched.serve.security.Gate`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DESCRIPTOR_RESERVE", "GuardedH11Protocol", "default_client_commands",
           "default_max_connections", "raise_descriptor_limit"]

log = logging.getLogger("metasched.serve")

# Descriptors kept for everything but client connections (the dispatcher's pipes,
# cgroup files, journal, the proxy's upstream connections, listening sockets).
DESCRIPTOR_RESERVE = 256


# What one running command holds in the service (its pipes, pidfd, cgroup and workspace
# files, its output's tails): measured 8 with E2B background commands.
DESCRIPTORS_PER_COMMAND = 8


def _soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's descriptor limit (soft) to its hard limit (at most 2**20),
    as far as it may; returns the limits before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(1 << 20, hard if hard != resource.RLIM_INFINITY else 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return soft, _soft_limit()


def default_client_commands() -> int:
    """Running commands each client may have at once when none is configured: half of
    what the descriptors kept beside connections (a quarter of the limit, at least
    :data:`DESCRIPTOR_RESERVE`) hold at :data:`DESCRIPTORS_PER_COMMAND` each, at least
    4: one client's commands cannot take every descriptor from the others'."""
    reserve = max(DESCRIPTOR_RESERVE, _soft_limit() // 4)
    return max(4, reserve // DESCRIPTORS_PER_COMMAND // 2)


def default_max_connections() -> int:
    """The connection cap when none is configured: this process's descriptor limit
    (soft), less :data:`DESCRIPTOR_RESERVE` or a quarter of it, whichever is more, at
    least 16."""
    soft = _soft_limit()
    return max(16, soft - max(DESCRIPTOR_RESERVE, soft // 4))


def _answer(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (see the
    module docstring). Made per connection by uvicorn; give the limits with
    ``functools.partial(GuardedH11Protocol, header_timeout_s=..., max_connections=...)``
    as uvicorn's ``http``.

    Args:
        header_timeout_s: seconds a request's headers may take to arrive.
        max_connections: connections open at once; more are refused.
    """

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.connections.discard(self)
            log.warning("refused a connection: %d open (max_connections)",
                        self.max_connections)
            transport.write(_answer(503, "Service Unavailable", f"connections: "
                                    f"{self.max_connections} already open here"))
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def data_received(self, data: bytes) -> None:
        # The first bytes of a kept-alive connection's next request start its deadline.
        waiting = self.conn.their_state is h11.IDLE
        if waiting and self._header_deadline is None and data:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in: the body's deadline is the Gate's

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.transport.write(_answer(408, "Request Timeout", f"headers: not received "
                                     f"within {self.header_timeout_s:g} s"))
        self.transport.close()
