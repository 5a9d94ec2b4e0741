"""Helpers kept one per event loop, and the epoll set that watches the children's
pipes and pidfds on behalf of that loop."""

from __future__ import annotations

import asyncio
import select
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["FdWatch", "PerLoop"]


class PerLoop:
    """Base of the helpers kept one per event loop (``for_loop``), in a weak-keyed map
    per subclass, so each goes with its loop; an instance therefore holds its loop only
    weakly (``self.loop()``), or the loop would never be freed."""

    _by_loop: weakref.WeakKeyDictionary

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._by_loop = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> Any:
        helper = cls._by_loop.get(loop)
        if helper is None:
            helper = cls._by_loop[loop] = cls(loop)
        return helper


class FdWatch(PerLoop):
    """The children's pipes and pidfds of one event loop, in an epoll set of their own
    that the loop watches as a single reader.

    Each action has three such descriptors; ``loop.add_reader``/``remove_reader`` spend
    ~8.6 µs of Python per descriptor (selector keys, handles, transport checks) against
    ~1.8 µs for registering in a plain ``select.epoll``, and a ready descriptor costs
    the loop a handle of its own instead of a share of one. Level-triggered: what a
    callback leaves unread is reported again on the loop's next turn.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.epoll = select.epoll()  # close-on-exec
        self.callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self.epoll.fileno(), self._dispatch)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        self.epoll.register(fd, select.EPOLLIN)
        self.callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed: a closed fd leaves the set by itself
        only once every duplicate of it is closed)."""
        if self.callbacks.pop(fd, None) is not None:
            self.epoll.unregister(fd)

    def _dispatch(self) -> None:
        for fd, _ in self.epoll.poll(0):
            callback = self.callbacks.get(fd)  # None if an earlier callback removed it
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - as the loop does for its handles
                loop = self.loop()
                if loop is not None:
                    loop.call_exception_handler({"message": "exception in a child fd "
                                                 "callback", "exception": exc})
