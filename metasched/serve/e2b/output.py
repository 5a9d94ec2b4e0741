"""A command's output while it runs: its watcher (:mod:`.programs`) writes the
command's stdout and stderr to ``.e2b/<pid>.out`` and ``.e2b/<pid>.err`` in the
workspace, and the service reads them from the host side as they grow.

The workspace is the sandbox's tmpfs, seen from the host through its namespaces'
init (``/proc/<init pid>/root/workspace``). Everything under it is opened relative to
the directory opened before (``openat``), never following a symbolic link
(``O_NOFOLLOW``), without blocking (``O_NONBLOCK``: a FIFO put there opens and is
refused) and only when it is a regular file: whatever the sandbox's processes put in
place of those names, the service reads nothing outside that workspace.

:class:`Output` holds one process's files; each reader (:meth:`Output.events`: the
``Start`` stream from the first byte, a ``Connect`` one from where the files are when
it connects) reads them at its own offsets when its client takes the next event, at
most :data:`CHUNK` bytes a piece, so nothing piles up in the service for a client that
reads slowly. When the action ends, each reads on to the end of the files, then sends
the end; the files are removed then (the open descriptors keep them for whoever still
reads). Where no host view of the workspace exists (no sandboxes, another backend) the
command writes to its action's own output, which comes at its end (the last
``tail_bytes`` of each).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator
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
    sandboxes = getattr(dispatcher, "sandboxes", None)
    get = getattr(sandboxes, "get", None)
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
    """The output files of process ``pid`` (see the module docstring): ``ws_fd`` its
    workspace's directory (owned from here on, closed at the end; None: no streaming,
    the output comes with ``result``)."""

    def __init__(self, pid: int, ws_fd: int | None, result: asyncio.Future[Result]) -> None:
        self.pid = pid
        self.ws_fd = ws_fd
        self.result = result
        self.ctl: int | None = None  # the control directory, once it is there
        self.fds: dict[str, int] = {}
        self.streamed = ws_fd is not None  # read from the workspace while it runs
        self.readers = 0
        self.removed = False
        result.add_done_callback(lambda _f: self._ended())

    def __del__(self) -> None:  # a reader never started: its descriptors go with it
        for fd in [*self.fds.values(), self.ctl, self.ws_fd]:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _open(self) -> None:
        """Open whichever of the files is not open yet (and there)."""
        if self.ws_fd is None or self.removed:
            return
        if self.ctl is None:
            self.ctl = _open_regular(CONTROL, self.ws_fd, directory=True)
            if self.ctl is None:
                return
        for stream, suffix in STREAMS:
            if stream not in self.fds:
                fd = _open_regular(f"{self.pid}{suffix}", self.ctl)
                if fd is not None:
                    self.fds[stream] = fd

    def _ended(self) -> None:
        """The action ended: the files are opened (for the readers to finish) and
        removed from the workspace."""
        self._open()
        self.removed = True
        if self.ctl is not None:
            for _, suffix in STREAMS:
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.pid}{suffix}", dir_fd=self.ctl)
            os.close(self.ctl)
            self.ctl = None
        if self.ws_fd is not None:
            os.close(self.ws_fd)
            self.ws_fd = None
        self._close()

    def _close(self) -> None:
        if self.removed and self.readers == 0:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def _size(self, stream: str) -> int:
        fd = self.fds.get(stream)
        return os.fstat(fd).st_size if fd is not None else 0

    def _piece(self, offsets: dict[str, int]) -> tuple[str, bytes] | None:
        """The next piece past ``offsets`` (advanced), or None."""
        for stream, _ in STREAMS:
            fd = self.fds.get(stream)
            if fd is None:
                continue
            try:
                data = os.pread(fd, CHUNK, offsets[stream])
            except OSError:
                continue
            if data:
                offsets[stream] += len(data)
                return stream, data
        return None

    def events(self, from_start: bool, idle_s: float) -> AsyncIterator[tuple[str, Any]]:
        """``("stdout" | "stderr", bytes)`` for each piece (from the first byte when
        ``from_start``, else from now), ``("keepalive", None)`` after ``idle_s``
        without one, then ``("end", result)`` (``None``: the action has no result, the
        service stops). The reader counts from this call: the files stay open for it."""
        self.readers += 1
        self._open()
        offsets = {stream: 0 if from_start else self._size(stream) for stream, _ in STREAMS}
        return self._events(offsets, from_start or not self.streamed, idle_s)

    async def _events(self, offsets: dict[str, int], own_output: bool, idle_s: float
                      ) -> AsyncIterator[tuple[str, Any]]:
        try:
            loop = asyncio.get_running_loop()
            delay, idle = POLL_MIN_S, 0.0
            while True:
                done = self.result.done()  # before reading: what follows is the end
                self._open()
                piece = self._piece(offsets)
                if piece is not None:
                    delay, idle = POLL_MIN_S, 0.0
                    yield piece
                    continue
                if done:
                    break
                if idle >= idle_s:
                    idle = 0.0
                    yield "keepalive", None
                t0 = loop.time()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.result),
                                           delay if self.streamed else idle_s)
                idle += loop.time() - t0
                delay = min(delay * 2, POLL_MAX_S)
            if self.result.cancelled() or self.result.exception() is not None:
                yield "end", None
                return
            result = self.result.result()
            # The action's own output: the command's where there is no view of the
            # workspace, else only what the watcher itself wrote (why it could not start).
            if own_output:
                for stream, _ in STREAMS:
                    text = getattr(result, stream)
                    if text:
                        yield stream, text.encode()
            yield "end", result
        finally:
            self.readers -= 1
            self._close()
