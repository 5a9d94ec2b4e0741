"""A command's output while it runs: its watcher (:mod:`.programs`) writes the
command's stdout and stderr to ``.e2b/<pid>.out`` and ``.e2b/<pid>.err`` in the
workspace, and the service reads them from the host side as they grow.

The workspace is the sandbox's tmpfs, seen from the host through its namespaces'
init (``/proc/<init pid>/root/workspace``). Everything under it is opened relative to
the directory opened before (``openat``), never following a symbolic link
(``O_NOFOLLOW``), without blocking (``O_NONBLOCK``: a FIFO put there opens and is
refused) and only when it is a regular file: whatever the sandbox's processes put in
place of those names, the service reads nothing outside that workspace.

:class:`Output` follows one process: each new piece of a stream goes to every
listener (the ``Start`` stream, and any ``Connect`` one from then on), at most
:data:`CHUNK` bytes a piece; when the action ends, what is left past the last read is
read to the end, the files are removed and the end goes out. Where no host view of
the workspace exists (no sandboxes, another backend) the command writes to its
action's own output, which comes at its end (the last ``tail_bytes`` of each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
from collections.abc import Callable
from typing import Any

from metasched.runtime.requests import Result
from metasched.serve.e2b.programs import CONTROL

__all__ = ["CHUNK", "Output", "workspace_fd"]

CHUNK = 64 * 1024  # bytes per data event at most
POLL_MIN_S, POLL_MAX_S = 0.005, 0.05  # between looks at the files: shortest, longest
WORKSPACE = "workspace"  # the workspace's path in the sandbox's root
STREAMS = (("stdout", ".out"), ("stderr", ".err"))
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def workspace_fd(dispatcher: Any, trajectory: str) -> int | None:
    """A directory descriptor of ``trajectory``'s workspace as the host sees it, or
    None where there is none (no sandbox of it, or one this process cannot see)."""
    boxes = getattr(dispatcher, "boxes", None)
    get = getattr(boxes, "get", None)
    box = get(trajectory) if get is not None else None
    init = getattr(box, "init_pid", -1)
    if not isinstance(init, int) or init <= 0:
        return None
    try:
        root = os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.open(WORKSPACE, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=root)
    except OSError:
        return None
    finally:
        os.close(root)


def _open_regular(name: str, dir_fd: int, directory: bool = False) -> int | None:
    """``name`` under ``dir_fd`` (no link followed), if it is a regular file (or a
    directory when ``directory``); else None."""
    try:
        fd = os.open(name, _FLAGS | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except OSError:
        return None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        os.close(fd)
        return None
    return fd


class Output:
    """The output of process ``pid`` (see the module docstring): ``ws_fd`` its
    workspace's directory (owned from here on, closed at the end; None: no streaming,
    the output comes with ``result``)."""

    def __init__(self, pid: int, ws_fd: int | None, result: asyncio.Future[Result]) -> None:
        self.pid = pid
        self.ws_fd = ws_fd
        self.result = result
        self.listeners: list[Callable[[str, Any], None]] = []
        self.fds: dict[str, int] = {}
        self.offsets = {stream: 0 for stream, _ in STREAMS}
        self.end: Result | None = None  # once the end went out
        self.task = asyncio.get_running_loop().create_task(self._follow())

    @property
    def streamed(self) -> bool:
        """Whether the output is read from the workspace while it runs."""
        return self.ws_fd is not None

    def listen(self, listener: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call ``listener("stdout" | "stderr", bytes)`` for each piece from now on,
        then ``listener("end", result)`` (``None`` when there is no result; at once
        if it has ended); returns what stops it."""
        if self.end is not None:
            listener("end", self.end)
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener) if listener in self.listeners else None

    def _emit(self, kind: str, value: Any) -> None:
        for listener in list(self.listeners):
            listener(kind, value)

    def _read(self, ctl: int | None, pieces: int = 16) -> bool:
        """Send what the files hold past the last read, at most ``pieces`` pieces of
        each stream (0: all); whether anything was new."""
        new = False
        for stream, suffix in STREAMS:
            fd = self.fds.get(stream)
            if fd is None and ctl is not None:
                fd = _open_regular(f"{self.pid}{suffix}", ctl)
                if fd is not None:
                    self.fds[stream] = fd
            if fd is None:
                continue
            for _ in itertools.count() if pieces == 0 else range(pieces):
                try:
                    data = os.pread(fd, CHUNK, self.offsets[stream])
                except OSError:
                    data = b""
                if not data:
                    break
                self.offsets[stream] += len(data)
                new = True
                self._emit(stream, data)
                if len(data) < CHUNK:
                    break
        return new

    async def _follow(self) -> None:
        ctl: int | None = None
        try:
            if self.ws_fd is not None:
                delay = POLL_MIN_S
                while not self.result.done():
                    if ctl is None:
                        ctl = _open_regular(CONTROL, self.ws_fd, directory=True)
                    new = self._read(ctl)
                    delay = POLL_MIN_S if new else min(delay * 2, POLL_MAX_S)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self.result), delay)
                if ctl is None:
                    ctl = _open_regular(CONTROL, self.ws_fd, directory=True)
                self._read(ctl, pieces=0)  # the rest, to the end
            result = await self.result
            # The action's own output: the command's where there is no view of the
            # workspace, else only what the watcher itself wrote (why it could not start).
            for stream, _ in STREAMS:
                text = getattr(result, stream)
                if text:
                    self._emit(stream, text.encode())
            self.end = result
            self._emit("end", result)
        finally:
            if self.end is None:  # no result (the service stops): the streams end too
                self._emit("end", None)
            if ctl is not None:
                for _, suffix in STREAMS:
                    with contextlib.suppress(OSError):
                        os.unlink(f"{self.pid}{suffix}", dir_fd=ctl)
                os.close(ctl)
            for fd in self.fds.values():
                os.close(fd)
            if self.ws_fd is not None:
                os.close(self.ws_fd)
