"""What the dispatcher keeps of an accepted request (:class:`Job`), and the names it
gives the core and the commands it starts."""

from __future__ import annotations

import asyncio
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


__all__ = ["ACTION_ENV", "COMMAND_SERVICE", "Job"]
