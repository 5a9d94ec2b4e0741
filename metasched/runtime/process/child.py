"""A running child: its output pipes and their tails, exit watching, killing, reaping.

Exit is awaited on a pidfd watched by the event loop (no thread per child; pidfds and
output pipes share one epoll set that the loop watches as one reader:
:class:`~.fd_watch.FdWatch`); without pidfds (Linux < 5.3, or a sandbox that forbids
the call) a thread waits with ``waitid(WNOWAIT)``. Either way the child stays a zombie
until this module reaps it, so its pid, which is also its process-group id, cannot be
reused while the group is being killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from typing import TYPE_CHECKING

from metasched.runtime.process.fd_watch import FdWatch

if TYPE_CHECKING:
    from metasched.runtime.sandbox.lifeline import Lifeline

__all__ = ["Child", "ChildBase", "Stream", "Tail", "close_fds", "kill_group"]

_READ_CHUNK = 65536  # a Linux pipe holds 64 KiB by default: one read empties it
_REAP_AFTER_CANCEL_S = 2.0  # how long a cancelled call waits for SIGKILL to take effect


def kill_group(pgid: int) -> None:
    """SIGKILL every process in process group ``pgid``; a group that is gone is fine.

    Raises:
        ValueError: ``pgid`` is 0, 1 or negative (``killpg(0)`` would kill the caller's
            own group).
    """
    if pgid <= 1:
        raise ValueError(f"refusing to kill process group {pgid}")
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def close_fds(*fds: int) -> None:
    """Close each descriptor, ignoring errors (cleanup paths must not raise)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Tail:
    """The last ``limit`` bytes of a stream (memory stays bounded whatever is written)."""

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = max(0, int(limit))

    def feed(self, data: bytes) -> None:
        if len(data) >= self.limit:
            self.buf[:] = data[len(data) - self.limit:]
        else:
            self.buf += data
            excess = len(self.buf) - self.limit
            if excess > 0:
                del self.buf[:excess]


class Stream:
    """A child's output pipe, read by the event loop into a bounded tail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, tail_bytes: int) -> None:
        self.watch = FdWatch.for_loop(loop)
        self.fd = fd
        self.tail = Tail(tail_bytes)
        self.eof = loop.create_future()
        os.set_blocking(fd, False)
        self.watch.add(fd, self._on_readable)

    def _read_once(self) -> bool:
        """One read into the tail; False when nothing more is readable now (closed at
        EOF or on an error)."""
        try:
            data = os.read(self.fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        self.tail.feed(data)
        return True

    def _on_readable(self) -> None:
        self._read_once()

    def drain_now(self) -> None:
        """Read until the pipe is empty (a bounded number of reads: a writer that
        escaped the group could keep it full); close it at EOF."""
        for _ in range(64):
            if self.fd < 0 or not self._read_once():
                return

    def close(self) -> None:
        if self.fd >= 0:
            self.watch.remove(self.fd)
            close_fds(self.fd)
            self.fd = -1
        if not self.eof.done():
            self.eof.set_result(None)

    def text(self) -> str:
        return self.tail.buf.decode("utf-8", errors="replace")

    def release(self) -> None:
        """Drop the kept output once it is in the outcome (a finished child may be held
        a while longer, in reference cycles the collector reaches late: its tail
        must not be)."""
        self.tail.buf = bytearray()


class ChildBase:
    """What the executor uses of a started command, whoever started it (this process:
    :class:`Child`; the sandbox server: ``metasched.runtime.process.sandboxed``): its
    ``exited`` future, its two output :class:`Stream` s, ``kill``, ``kill_rest`` and
    ``reap`` (the subclass's), and the waiting below."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int, out_fd: int, err_fd: int,
                 tail_bytes: int) -> None:
        self.loop = loop
        self.pid = pid
        self.exited: asyncio.Future[None] = loop.create_future()
        self.killed_by: str | None = None
        self.reaped = False
        self.returncode: int | None = None
        self.maxrss_bytes = 0
        self.cpu_s = 0.0
        self.pids_limited = False  # its cgroup refused it a fork
        self.out = Stream(loop, out_fd, tail_bytes)
        self.err = Stream(loop, err_fd, tail_bytes)

    def reap(self) -> None:
        raise NotImplementedError

    async def reap_after_kill(self) -> None:
        """After SIGKILL: wait (bounded, even if cancelled again) for the exit, reap."""
        if not self.exited.done():
            try:
                await asyncio.wait([self.exited], timeout=_REAP_AFTER_CANCEL_S)
            except asyncio.CancelledError:
                pass
        if self.exited.done() and not self.reaped:
            self.reap()

    async def drained(self, grace_s: float) -> None:
        """Wait for EOF on both pipes, at most ``grace_s`` (a process that left the
        group with setsid may still hold them)."""
        # Usually every writer is gone by now (the group was killed): read what is left
        # at once rather than waiting for the loop to report it.
        self.out.drain_now()
        self.err.drain_now()
        pending = [s.eof for s in (self.out, self.err) if not s.eof.done()]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)

    def close(self) -> None:
        self.out.close()
        self.err.close()


class Child(ChildBase):
    """A started child: exit notification, reaping, killing, and its two output pipes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen,
                 out_fd: int, err_fd: int, tail_bytes: int, *,
                 lifeline: Lifeline | None = None) -> None:
        self.proc = proc  # reaped here, not by Popen (see reap())
        self.lifeline = lifeline  # told before the reap: the group id is then free
        self.pidfd = -1
        self.watch = FdWatch.for_loop(loop)
        super().__init__(loop, proc.pid, out_fd, err_fd, tail_bytes)
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # No pidfds (old kernel, or a sandbox forbidding the call): a thread waits
            # without reaping (WNOWAIT), so the pid stays ours until reap().
            threading.Thread(target=self._wait_in_thread, name=f"wait-{self.pid}",
                             daemon=True).start()
        else:
            self.watch.add(self.pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._close_pidfd()
        if not self.exited.done():
            self.exited.set_result(None)

    def _wait_in_thread(self) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        try:
            self.loop.call_soon_threadsafe(self._on_exit)
        except RuntimeError:  # the loop is closed; nobody is waiting any more
            pass

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            self.watch.remove(self.pidfd)
            close_fds(self.pidfd)
            self.pidfd = -1

    def kill(self, why: str) -> None:
        """Kill the group (only while the leader is unreaped: its pid is still ours)."""
        if self.reaped:
            return
        if self.killed_by is None:
            self.killed_by = why
        kill_group(self.pid)

    def kill_rest(self) -> None:
        """After the leader's exit, before reaping: kill what is left of its group (the
        zombie leader's pid still names the group, so it cannot have been reused)."""
        kill_group(self.pid)

    def reap(self) -> None:
        """Collect the exited leader's status and resource usage (does not block)."""
        if self.lifeline is not None:
            self.lifeline.forget(self.pid)
        try:
            _, status, usage = os.wait4(self.pid, 0)
        except ChildProcessError:
            self.returncode = None
        else:
            self.returncode = os.waitstatus_to_exitcode(status)
            self.maxrss_bytes = usage.ru_maxrss * 1024  # KiB on Linux
            self.cpu_s = usage.ru_utime + usage.ru_stime
        self.reaped = True
        # wait4 (not Popen.wait) gives the peak RSS and CPU time; Popen would otherwise
        # warn that the child "is still running" and keep it in its list to poll.
        self.proc.returncode = self.returncode if self.returncode is not None else -1
        self._close_pidfd()

    def reap_in_background(self) -> None:
        """The leader outlived SIGKILL (uninterruptible sleep): reap it when it exits."""
        def reap_later(_: asyncio.Future[None]) -> None:
            if not self.reaped:
                self.reap()
        self.exited.add_done_callback(reap_later)
