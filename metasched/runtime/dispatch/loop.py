"""The dispatcher's clock and its event loop: the one place that knows the time, whether
the dispatcher runs, and when the next scheduling pass comes (:class:`DispatchLoop`).

Every part reads the time and asks for a pass through this object: ``now()`` is seconds
since the dispatcher was made (the core's clock), ``wall(t)`` the same instant as wall
time, and ``kick()`` runs the pass once per loop turn, however many events asked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["DispatchLoop"]


class DispatchLoop:
    """The clock, the asyncio loop and the scheduling pass's wake-ups of one dispatcher.

    Args:
        clock: monotonic seconds (tests inject a fake clock).
        on_pass: the scheduling pass (run by :meth:`kick`, once per loop turn; it calls
            :meth:`pass_started` first, as does a pass run directly).
    """

    def __init__(self, clock: Callable[[], float], on_pass: Callable[[], None]) -> None:
        self._clock = clock
        self._t0 = clock()
        self.wall0 = time.time()  # wall time at the clock's zero
        self._on_pass = on_pass
        self.aio: asyncio.AbstractEventLoop | None = None  # set by bind() (at start)
        self.closed = False  # nothing new starts once set
        self._kick_pending = False
        self._turn_passed = False  # a pass ran for an event of this loop turn
        self._wake: asyncio.TimerHandle | None = None  # the next quota refill or deadline

    def bind(self) -> None:
        """Run on the running event loop from now on."""
        self.aio = asyncio.get_running_loop()

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self.aio is not None and not self.closed

    def now(self) -> float:
        """Seconds since the dispatcher was made (the core state's clock)."""
        return self._clock() - self._t0

    def monotonic(self) -> float:
        """The clock itself (monotonic seconds, not since the start)."""
        return self._clock()

    def wall(self, t: float | None = None) -> float:
        """The instant ``t`` of the core's clock (default: now) as wall time."""
        return self.wall0 + (self.now() if t is None else t)

    def kick(self) -> None:
        """Ask for a scheduling pass soon (once per loop turn, however many events)."""
        if not self._kick_pending and self.aio is not None and not self.closed:
            self._kick_pending = True
            self.aio.call_soon(self._on_pass)

    def pass_now(self) -> None:
        """A pass now, for the first event of a loop turn that frees resources (the
        time from an exit to the next start is what leaves a freed core idle); the
        turn's later ones get one pass after the turn (:meth:`kick`), not one each: a
        frame of results from a node is one pass or two, not one per result."""
        if self._turn_passed:
            self.kick()
            return
        self._turn_passed = True
        assert self.aio is not None, "not started"
        self.aio.call_soon(self._next_turn)
        self._on_pass()

    def _next_turn(self) -> None:
        self._turn_passed = False

    def pass_started(self) -> None:
        """A scheduling pass runs now (asked for or not): a kick from here on asks for
        another."""
        self._kick_pending = False

    def future(self) -> asyncio.Future[Any]:
        """A future on the dispatcher's loop (the running one before the start)."""
        return (self.aio or asyncio.get_running_loop()).create_future()

    def task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task on the dispatcher's loop."""
        assert self.aio is not None, "not started"
        return self.aio.create_task(coro)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> asyncio.Handle:
        """Run ``callback(*args)`` at the next loop turn."""
        assert self.aio is not None, "not started"
        return self.aio.call_soon(callback, *args)

    def call_later(self, delay: float, callback: Callable[..., Any],
                   *args: Any) -> asyncio.TimerHandle:
        """Run ``callback(*args)`` in ``delay`` seconds."""
        assert self.aio is not None, "not started"
        return self.aio.call_later(delay, callback, *args)

    def wake_in(self, delay: float) -> None:
        """A pass in ``delay`` seconds at the latest (an earlier wake-up armed stays)."""
        loop = self.aio
        if loop is None:
            return
        at = loop.time() + delay
        h = self._wake
        if h is not None and not h.cancelled() and h.when() <= at and h.when() > loop.time():
            return
        if h is not None:
            h.cancel()
        self._wake = loop.call_at(at, self.kick)

    def stop(self) -> None:
        """Closed: no pass runs from now on, and the armed wake-up is dropped."""
        self.closed = True
        if self._wake is not None:
            self._wake.cancel()
