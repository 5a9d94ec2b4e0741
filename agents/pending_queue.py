"""Pending actions in a scheduler's priority order, kept incrementally.

A decision must cost O(examined x log n), not a sort of the whole queue: live queues hold
thousands of actions, and so do contended simulations (2,000 code runs waiting for 34
sandbox slots). Schedulers keep :class:`PendingQueue` heaps and feed them the actions
that :class:`Arrivals` finds submitted since their last decision.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from metasched.core.actions import Action
from metasched.core.state import ClusterState


class PendingQueue:
    """Pending actions in a fixed priority order. Actions no longer pending (started,
    failed) are dropped when met; everything a scan yields stays queued (a decision is
    advice until applied)."""

    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[tuple[tuple, Action]] = []

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, key: tuple, a: Action) -> None:
        """Queue ``a`` under ``key`` (smallest first; keys must be unique, e.g. end with
        the action's id)."""
        heapq.heappush(self.heap, (key, a))

    def scan_keyed(self, pending: dict[int, Action]) -> Iterator[tuple[tuple, Action]]:
        """Yield (key, action) of the actions still in ``pending``, best first; the caller
        breaks when done."""
        heap = self.heap
        taken: list[tuple[tuple, Action]] = []
        try:
            while heap:
                item = heapq.heappop(heap)
                if pending.get(item[1].id) is not item[1]:
                    continue  # started (or failed) since it was queued
                taken.append(item)
                yield item
        finally:
            for item in taken:
                heapq.heappush(heap, item)

    def scan(self, pending: dict[int, Action]) -> Iterator[Action]:
        """The actions still in ``pending``, best first."""
        for _, a in self.scan_keyed(pending):
            yield a


class Arrivals:
    """Finds the actions submitted since the last look, per kind.

    Arrivals are read from the end of the state's pending dict (ids grow in submission
    order), so a look costs the number of new actions. A new state (a new run) starts
    over: :meth:`new_run` says so, and the owner should drop its queues.
    """

    __slots__ = ("state", "last")

    def __init__(self) -> None:
        self.state: ClusterState | None = None
        self.last: dict[str, int] = {}

    def new_run(self, state: ClusterState) -> bool:
        """True (once) when ``state`` is not the one seen last."""
        if self.state is state:
            return False
        self.state = state
        self.last = {"cpu": -1, "gpu": -1, "api": -1}
        return True

    def new(self, state: ClusterState, kind: str) -> list[Action]:
        """Pending actions of ``kind`` submitted since the last call, newest first."""
        last = self.last[kind]
        out = []
        for a in reversed(state.pending[kind].values()):
            if a.id <= last:
                break
            out.append(a)
        if out:
            self.last[kind] = out[0].id
        return out


__all__ = ["Arrivals", "PendingQueue"]
