"""What the dispatcher keeps of an accepted request (:class:`Job`), the table of those
not finished yet (:class:`JobTable`), and the names it gives the core and the commands
it starts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from metasched.core.actions import Action
from metasched.runtime.requests import Request
from metasched.runtime.sandbox.manager import Sandbox

COMMAND_SERVICE = "@command"  # the core's service for gpu commands (no model to load)
ACTION_ENV = "METASCHED_ACTION_ID"  # set in every command's environment (orphan check)


class Job:
    """A request the dispatcher has accepted, with its future and timings."""

    __slots__ = ("request", "future", "queued_at", "started_at", "action", "alloc", "attempts",
                 "sandbox", "process")

    def __init__(self, request: Request, future: asyncio.Future, queued_at: float,
                 attempts: int = 0) -> None:
        self.request = request
        self.future = future
        self.queued_at = queued_at
        self.started_at: float | None = None
        self.action: Action | None = None
        self.alloc: dict[str, Any] = {}
        self.attempts = attempts
        self.sandbox: Sandbox | None = None  # where its command runs (isolation on)
        self.process: Any = None  # its command once started here (what a cancel kills)


class JobTable:
    """The jobs accepted and not finished, by request id and, once queued, by the id of
    their action in the core; it numbers the actions."""

    def __init__(self) -> None:
        self._by_id: dict[str, Job] = {}  # by request id, until finished
        self._by_action: dict[int, Job] = {}
        self._next_action = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._by_id.values()))

    def get(self, rid: str) -> Job | None:
        """The unfinished job of request ``rid``, if any."""
        return self._by_id.get(rid)

    def add(self, job: Job) -> None:
        """``job`` is accepted (until :meth:`forget`)."""
        self._by_id[job.request.id] = job

    def of_action(self, action_id: int) -> Job:
        """The job whose action in the core has id ``action_id`` (KeyError if none)."""
        return self._by_action[action_id]

    def new_action(self, job: Job, make: Callable[[int], Action]) -> Action:
        """Number ``job``'s action: ``make(action_id)`` builds it; it is the job's from
        now on."""
        a = job.action = make(self._next_action)
        self._next_action += 1
        self._by_action[a.id] = job
        return a

    def drop(self, rid: str) -> None:
        """Forget request ``rid``'s job (not queued: e.g. its journal write failed)."""
        self._by_id.pop(rid, None)

    def forget(self, job: Job) -> None:
        """``job`` is finished: forget it."""
        self._by_id.pop(job.request.id, None)
        if job.action is not None:
            self._by_action.pop(job.action.id, None)


def taken(rid: str) -> str:
    """Why a request is rejected whose id belongs to another request."""
    return (f"{rid!r} was accepted before with a different request; give this one another "
            f"id (or, to start over, use a new journal)")


__all__ = ["ACTION_ENV", "COMMAND_SERVICE", "Job", "JobTable", "taken"]
