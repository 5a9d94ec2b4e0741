"""Messages between the dispatcher and its sandbox server: one ``marshal``-encoded dict
per datagram of a ``SOCK_SEQPACKET`` socket pair (message boundaries kept by the kernel,
no framing), with file descriptors passed alongside (``SCM_RIGHTS``).

``marshal`` rather than JSON: both ends are the same interpreter, and commands'
environments are bytes (the form ``execve`` takes), which JSON cannot carry.
"""

from __future__ import annotations

import array
import marshal
import socket
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_MESSAGE", "MAX_FDS", "receive", "send", "socket_pair"]

MAX_MESSAGE = 1 << 20  # a request's argv and environment together (execve allows ~2 MB)
MAX_FDS = 16


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair (close-on-exec; the server's end is made inheritable by the
    caller when it starts the server)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE + 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE + 4096)
    return a, b


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message (and ``fds``, which the receiver gets copies of).

    Raises:
        ValueError: the message is larger than :data:`MAX_MESSAGE`.
        OSError: the other end is gone.
    """
    data = marshal.dumps(message)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sock.sendmsg([data], ancillary)
    else:
        sock.sendmsg([data])


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors sent with it (close-on-exec); ``(None, [])`` at
    end of stream. Raises ``BlockingIOError`` on a non-blocking socket with nothing to
    read."""
    fd_size = array.array("i").itemsize
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * fd_size),
                                       socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[:len(payload) - len(payload) % fd_size])
            fds.extend(arr)
    if not data:
        for fd in fds:
            socket.close(fd)
        return None, []
    return marshal.loads(data), fds
