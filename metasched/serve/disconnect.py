"""A request whose HTTP client went away is cancelled: :func:`unless_disconnected` runs a
route's work while it watches the connection (the ASGI receive channel, which, once the
body is read, yields ``http.disconnect`` when the client closes it) and, if the client
leaves first, cancels the dispatcher's actions the work had submitted (dropped if
queued, killed if running: :mod:`metasched.runtime.dispatch.cancellation`) and the
work itself (no further step of it starts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

__all__ = ["Gone", "unless_disconnected", "until_disconnected"]

T = TypeVar("T")


class Gone(Exception):
    """The client disconnected before the answer (nobody reads what would follow)."""


async def until_disconnected(request: Request) -> None:
    """Return when the client of ``request`` disconnects (its body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T],
                              on_disconnect: Callable[[], None]) -> T:
    """``await work``, unless the client disconnects first: then ``on_disconnect()``
    (cancel what ``work`` submitted), ``work`` is cancelled and :class:`Gone` raised.

    Raises:
        Gone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        on_disconnect()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Gone
    finally:
        watch.cancel()
        if not task.done():  # the handler itself was cancelled (the server stops)
            task.cancel()
