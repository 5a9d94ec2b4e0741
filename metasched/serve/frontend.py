"""What the service needs of the dispatcher it fronts (:class:`DispatcherLike`), and what
it keeps about the requests it accepted (:class:`Submissions`).

The service fronts any object with the dispatcher's submitting and reading methods: the
local :class:`~metasched.runtime.dispatch.Dispatcher`, or a handle on one that runs
elsewhere (e.g. in a Ray actor), which then forwards them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from metasched.runtime.requests import Request, Result

__all__ = ["DispatcherLike", "Submissions"]


@runtime_checkable
class DispatcherLike(Protocol):
    """The dispatcher's methods the service calls (see
    :class:`~metasched.runtime.dispatch.Dispatcher` for their contracts)."""

    async def start(self) -> None: ...

    async def close(self, *, drain: bool = True) -> None: ...

    def accept(self, request: Request | Mapping[str, Any], *,
               call: Callable[[], Awaitable[Any]] | None = None) -> asyncio.Future[Result]:
        """The future of the request's result (a rejected one's is done at once)."""

    async def enqueue(self, request: Request | Mapping[str, Any], *,
                      call: Callable[[], Awaitable[Any]] | None = None
                      ) -> asyncio.Future[Result]:
        """As ``accept``, returning once the request is durable."""

    def stats(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where ``rid`` stands (a dispatcher elsewhere returns an awaitable of it)."""

    def close_trajectory(self, name: str) -> None: ...


@runtime_checkable
class RecoversLater(Protocol):
    """A dispatcher that starts without its journal's unfinished requests
    (``start(recover=False)``) and takes them up when told (``recover()``): the service
    probes its languages first, so that its start does not wait behind them."""

    async def start(self, *, recover: bool = True) -> None: ...

    def recover(self) -> None: ...


# The output (stdout, stderr) the last results kept in memory may hold together: a
# download's pieces (each a result of up to tail_bytes) must not pile up in the service.
KEEP_OUTPUT_BYTES = 8 * 2**20


def _output_bytes(r: Result) -> int:
    return len(r.stdout) + len(r.stderr)


class Submissions:
    """The requests accepted through the service: the futures of those in flight, and the
    last ``keep`` results, whose output holds at most ``keep_bytes`` together (older ones
    are asked of the dispatcher, whose journal keeps every result)."""

    def __init__(self, dispatcher: Callable[[], DispatcherLike], keep: int,
                 keep_bytes: int = KEEP_OUTPUT_BYTES) -> None:
        self._dispatcher = dispatcher
        self.keep = keep
        self.keep_bytes = keep_bytes
        self.pending: dict[str, asyncio.Future[Result]] = {}
        self.done: OrderedDict[str, Result] = OrderedDict()
        self._bytes = 0  # the output the kept results hold

    def track(self, rid: str, future: asyncio.Future[Result]) -> None:
        """Remember ``future`` under ``rid`` until its result is in, then the result."""
        if future.done():
            self._finished(rid, future)
            return
        self.pending[rid] = future
        future.add_done_callback(lambda f: self._finished(rid, f))

    def _finished(self, rid: str, future: asyncio.Future[Result]) -> None:
        if self.pending.get(rid) is future:
            del self.pending[rid]
        if future.cancelled() or self.keep == 0:
            return
        old = self.done.pop(rid, None)
        if old is not None:
            self._bytes -= _output_bytes(old)
        result = future.result()
        self.done[rid] = result
        self._bytes += _output_bytes(result)
        while self.done and (len(self.done) > self.keep or self._bytes > self.keep_bytes):
            self._bytes -= _output_bytes(self.done.popitem(last=False)[1])

    async def lookup(self, rid: str
                     ) -> tuple[str, Result | None, asyncio.Future[Result] | None]:
        """``(state, result, future)``: state ``queued``, ``running`` (result None,
        future set while it is this service's), ``finished`` (the result), or
        ``unknown``."""
        result = self.done.get(rid)
        if result is not None:
            return "finished", result, None
        found = self._dispatcher().find(rid)
        if inspect.isawaitable(found):  # asked of a dispatcher elsewhere (a Ray actor)
            found = await found
        future = self.pending.get(rid)
        if found is None:
            return ("queued", None, future) if future is not None else ("unknown", None, None)
        state, result = found
        return state, result, future
