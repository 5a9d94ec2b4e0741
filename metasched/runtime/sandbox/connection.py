"""The dispatcher's end of the sandbox server (:mod:`.server`): starting it, requests
and their replies, and the server's events (a command's exit, a sandbox ready)
delivered on the event loop.

Spawning is synchronous or pipelined. :meth:`ServerConnection.spawn` returns once the
server has started the command (or failed to), so the caller holds a running command,
as with a local spawn. :meth:`ServerConnection.spawn_later` only sends the request: its
reply (the pid, or why it failed) is delivered on the loop like an event, so the caller's
loop goes on while the server starts the command (a spawn takes the server about a
millisecond: see ``benchmarks/ray_throughput.py``). Replies come in order, a command's
spawn reply before its exit; an event read while waiting for a reply is kept and
delivered on the loop right after.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from metasched.runtime.sandbox import protocol

__all__ = ["ServerConnection", "ServerGone", "spawned_pid"]

_START_TIMEOUT_S = 30.0


def spawned_pid(reply: dict[str, Any]) -> int:
    """The pid in the server's reply to a spawn.

    Raises:
        OSError: it could not start (errno and message of the failure).
    """
    if "pid" not in reply:
        raise OSError(reply.get("errno") or 0, reply.get("error", "cannot start"))
    return reply["pid"]


class ServerGone(RuntimeError):
    """The sandbox server exited (every sandbox and command with it)."""


class ServerConnection:
    """Starts the sandbox server and talks to it.

    Args:
        home_cgroups: descriptors of this process's own ``cgroup.procs`` files in the
            hierarchies slots use (the server returns there after each spawn); sent to
            the server and closed here.
        refuse_userns: have the server refuse new user namespaces to everything it
            starts (:mod:`.userns`); :attr:`userns` says whether it could.

    Raises:
        ServerGone: the server did not start.
    """

    def __init__(self, home_cgroups: Sequence[int] = (), *,
                 refuse_userns: bool = False) -> None:
        mine, theirs = protocol.socket_pair()
        self.sock = mine
        package_root = str(Path(__file__).resolve().parents[3])
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": package_root, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "metasched.runtime.sandbox.server",
                 str(theirs.fileno()), *(["--refuse-userns"] if refuse_userns else [])],
                pass_fds=(theirs.fileno(),), env=env, cwd="/", stdin=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.handlers: dict[tuple[str, int], Callable[[dict[str, Any]], None]] = {}
        self._events: deque[dict[str, Any]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone = False
        self.sock.settimeout(_START_TIMEOUT_S)
        try:
            self._send({"op": "hello"}, home_cgroups)
            hello = self._wait_reply("hello", None)
        except (OSError, ServerGone) as e:
            self.close()
            raise ServerGone(f"the sandbox server did not start: {e}") from None
        finally:
            for fd in home_cgroups:
                os.close(fd)
        self.sock.settimeout(None)
        # "refused", or why new user namespaces are open to what the server starts.
        self.userns: str = hello.get("userns", "open")

    # --- delivery on the event loop -----------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver events on ``loop`` from now on."""
        self._loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._on_readable)
        if self._events:
            loop.call_soon(self._deliver)

    def detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        self._loop = None

    def on(self, kind: str, key: int, handler: Callable[[dict[str, Any]], None]) -> None:
        """Call ``handler(event)`` once for the event ``kind`` (``"exit"`` of command
        ``key``, ``"opened"`` of sandbox ``key``, ``"spawned"``: the reply to
        :meth:`spawn_later` for command ``key``)."""
        self.handlers[(kind, key)] = handler

    def forget(self, kind: str, key: int) -> None:
        """Drop the handler of ``kind`` for ``key`` (its event will not come)."""
        self.handlers.pop((kind, key), None)

    def _next(self) -> dict[str, Any] | None:
        """The next message (None: the server is gone); raises BlockingIOError when a
        non-blocking socket has none. No message carries descriptors this way."""
        try:
            msg, fds = protocol.receive(self.sock)
        except BlockingIOError:
            raise
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._lost()
        return msg

    def _on_readable(self) -> None:
        while True:
            try:
                msg = self._next()
            except BlockingIOError:
                break
            if msg is None:
                return
            self._events.append(msg)
        self._deliver()

    def _deliver(self) -> None:
        while self._events:
            msg = self._events.popleft()
            ev = msg.get("ev") or ("spawned" if msg.get("re") == "spawn" else None)
            key = msg.get("sid") if ev == "opened" else msg.get("cmd")
            handler = self.handlers.pop((ev, key), None)
            if handler is not None:
                handler(msg)

    def _lost(self) -> None:
        """The server is gone: every pending exit and open ends now, as failures."""
        if self._gone:
            return
        self._gone = True
        self.detach()
        for (kind, key), handler in list(self.handlers.items()):
            handler({"ev": kind, "cmd": key, "sid": key, "status": -1, "lost": True,
                     "error": "the sandbox server exited"})
        self.handlers.clear()

    # --- requests -----------------------------------------------------------------------

    def _send(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if self._gone:
            raise ServerGone("the sandbox server exited")
        try:
            protocol.send(self.sock, msg, fds)
        except BlockingIOError:
            self.sock.setblocking(True)
            try:
                protocol.send(self.sock, msg, fds)
            finally:
                self.sock.setblocking(self._loop is None)
        except OSError:
            self._lost()
            raise ServerGone("the sandbox server exited") from None

    def _wait_reply(self, kind: str, key: int | None) -> dict[str, Any]:
        """Read until the reply ``kind`` (for ``key``) arrives; keep events for later."""
        blocking = self.sock.getblocking()
        self.sock.setblocking(True)
        try:
            while True:
                msg = self._next()
                if msg is None:
                    raise ServerGone("the sandbox server exited")
                if msg.get("re") == kind and (key is None or msg.get("cmd") == key):
                    return msg
                self._events.append(msg)
        finally:
            self.sock.setblocking(blocking)
            if self._events and self._loop is not None:
                self._loop.call_soon(self._deliver)

    def spawn(self, request: dict[str, Any], fds: Sequence[int]) -> int:
        """Start a command (see the server's ``spawn``); its pid.

        Raises:
            OSError: it could not start (errno and message of the failure).
            ServerGone: the server exited.
        """
        self._send({"op": "spawn", **request}, fds)
        return spawned_pid(self._wait_reply("spawn", request["cmd"]))

    def spawn_later(self, request: dict[str, Any], fds: Sequence[int],
                    on_reply: Callable[[dict[str, Any]], None]) -> None:
        """Send a spawn request without waiting (the connection must be attached to a
        loop): ``on_reply(reply)`` is called there with its ``pid``, or without one (its
        ``errno`` and ``error``; the server exited: ``lost``). The descriptors are the
        server's once this returns; the caller may close its own.

        Raises:
            ServerGone: the server exited before the request could be sent.
        """
        self.on("spawned", request["cmd"], on_reply)
        try:
            self._send({"op": "spawn", **request}, fds)
        except ServerGone:
            self.forget("spawned", request["cmd"])
            raise

    def open(self, request: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Ask for a sandbox; the ``"opened"`` event for its ``sid`` says when it is ready
        (or why it failed). ``fds``: a gVisor sandbox's cgroup.procs files."""
        self._send({"op": "open", **request}, fds)

    def kill(self, cmd: int) -> None:
        """SIGKILL a command's process group (when no cgroup can)."""
        if not self._gone:
            self._send({"op": "kill", "cmd": cmd})

    def close_sandbox(self, sid: int) -> None:
        """End a sandbox and everything in it."""
        if not self._gone:
            try:
                self._send({"op": "close", "sid": sid})
            except ServerGone:
                pass

    @property
    def alive(self) -> bool:
        return not self._gone

    def close(self) -> None:
        """Stop the server: it kills every command and sandbox, then exits."""
        self.detach()
        self._gone = True
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
