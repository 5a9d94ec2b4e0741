"""A command started by the sandbox server (in a sandbox, or on the host inside its
cgroup slot), as the CPU executor sees it: the same interface as a
locally spawned :class:`~metasched.runtime.process.child.Child` (exit future, kill,
reap, output pipes), backed by the sandbox server instead of a pidfd.

The server is the command's parent: it reaps it and reports its wait status and
resource usage, so "reaping" here only reads that report. Killing goes through the
command's cgroup slot (every process in it, including any that left its session) or,
without cgroups, through the server (its process group). A memory or process limit hit
inside the slot is read from the slot's counters when the command ends.

The process package holds it (not :mod:`metasched.runtime.sandbox`): the sandbox layer
knows nothing of how a command is started and watched, the process layer uses it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from metasched.runtime.process.child import ChildBase
from metasched.runtime.sandbox.manager import Sandbox, Sandboxes, Started

__all__ = ["SandboxedChild"]


class SandboxedChild(ChildBase):
    """A command the sandbox server started (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sandboxes: Sandboxes,
                 sandbox: Sandbox | None, started: Started, out_fd: int, err_fd: int,
                 tail_bytes: int) -> None:
        super().__init__(loop, started.pid, out_fd, err_fd, tail_bytes)
        self.sandboxes, self.sandbox, self.started = sandboxes, sandbox, started
        self._event: dict[str, Any] | None = None
        self._released = False
        self._kill_when_started = False
        # Started without waiting: why it did not start, once the server has said so
        # (then ``exited`` is set without an exit).
        self.start_error: OSError | None = None
        sandboxes.on_exit(started, self._on_exit)
        if started.spawned is not None:
            started.spawned.add_done_callback(self._on_spawned)

    def _on_spawned(self, fut: asyncio.Future[int]) -> None:
        if fut.exception() is not None:  # never cancelled: the manager only sets it
            self.start_error = fut.exception()
            self.sandboxes.server.forget("exit", self.started.cmd)
            self.reaped = True  # nothing to reap
            if not self.exited.done():
                self.exited.set_result(None)
            return
        self.pid = self.started.pid = fut.result()
        if self._kill_when_started:  # a kill came before the server had started it
            self.sandboxes.kill(self.started)

    def _on_exit(self, event: dict[str, Any]) -> None:
        self._event = event
        slot = self.started.slot
        if slot is not None:
            memory, pids = slot.exceeded()
            if memory and self.killed_by is None:
                self.killed_by = "memory"  # the kernel killed in the slot: definitive
            self.pids_limited = pids
        if not self.exited.done():
            self.exited.set_result(None)

    def kill(self, why: str) -> None:
        """Kill every process of the command (a no-op once it has been reaped)."""
        if self.reaped:
            return
        if self.killed_by is None:
            self.killed_by = why
        if self.started.pid is None:
            # Its spawn is on its way to, or in, the server: the slot may still be empty,
            # and while the server spawns it the server itself is in the slot (it enters
            # the command's cgroups for that call), where a kill would take the server
            # and every sandbox with it. The kill follows the server's reply instead.
            self._kill_when_started = True
            return
        self.sandboxes.kill(self.started)

    def kill_rest(self) -> None:
        """After the leader's exit: what is left of the command (its slot: daemons too)."""
        self.sandboxes.kill(self.started)

    def reap(self) -> None:
        """Take the exit status and usage the server reported (after ``exited``)."""
        ev = self._event or {"status": -1}
        status = ev.get("status", -1)
        self.returncode = None if status < 0 else os.waitstatus_to_exitcode(status)
        self.maxrss_bytes = int(ev.get("maxrss_kb", 0)) * 1024
        self.cpu_s = float(ev.get("cpu_s", 0.0))
        self.reaped = True

    def reap_in_background(self) -> None:
        """Nothing to do: the server reaps; the slot is released when it reports."""
        self.exited.add_done_callback(lambda _: self.release())

    def release(self) -> None:
        """Give the command's slot and user id back (once it has exited)."""
        if self._released or not self.exited.done():
            return
        self._released = True
        self.sandboxes.finished(self.sandbox, self.started)

    def close(self) -> None:
        super().close()
        self.release()
