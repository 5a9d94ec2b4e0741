"""The direct stream between a dispatcher and one node's daemon (``submit="stream"``):
commands one way, results the other, on one TCP connection per node.

Why not Ray calls: one Ray actor call costs this machine about 0.75 ms of CPU in the
caller and 0.9 ms in the callee (``benchmarks/ray_throughput.py`` prints them), paid on
every action by both the dispatcher and the daemon, more than the dispatcher's own work
per action. A frame on a stream costs tens of µs, and everything one side has to say in
one turn of its event loop goes in one frame (:class:`Outbox`), so under load each frame
carries many commands or results with no wait added to any of them. Ray still places the
daemons, starts and ends them, and carries the secret that opens the stream.

Who may send: the daemon listens on its node's address (the one Ray uses) on a port the
kernel picks, and serves a connection only once it has shown that it holds the secret
the dispatcher gave the daemon through Ray: the daemon sends a fresh random nonce, the
peer answers HMAC-SHA256(secret, nonce) (:func:`serve_challenge`,
:func:`answer_challenge`), so the secret itself never crosses the network. Frames are
pickles, read only from a peer that has answered.

A frame: a 4-byte big-endian length, then a pickle of a list of messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import pickle
import secrets
import struct
from typing import Any

__all__ = ["ChannelError", "Outbox", "answer_challenge", "new_secret", "read_frame",
           "serve_challenge", "write_frame"]

_LENGTH = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a frame longer than this is a broken stream, not a message
NONCE_BYTES = 32
CHALLENGE_TIMEOUT_S = 10.0  # how long a connecting peer has to answer the challenge


class ChannelError(ConnectionError):
    """The stream broke or carried something that is not a frame."""


def new_secret() -> bytes:
    """A fresh secret for one stream's challenge."""
    return secrets.token_bytes(32)


def _answer(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


async def serve_challenge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          secret: bytes) -> bool:
    """Whether the peer that connected holds ``secret`` (it answers a fresh nonce within
    ``CHALLENGE_TIMEOUT_S``)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(nonce)
    try:
        await writer.drain()
        answer = await asyncio.wait_for(reader.readexactly(hashlib.sha256().digest_size),
                                        CHALLENGE_TIMEOUT_S)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return False
    return hmac.compare_digest(answer, _answer(secret, nonce))


async def answer_challenge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           secret: bytes) -> None:
    """Answer the daemon's challenge with ``secret``.

    Raises:
        ChannelError: the daemon closed the stream first.
    """
    try:
        nonce = await reader.readexactly(NONCE_BYTES)
    except asyncio.IncompleteReadError:
        raise ChannelError("the node's daemon closed the stream before its challenge") from None
    writer.write(_answer(secret, nonce))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> list[Any]:
    """The next frame's messages.

    Raises:
        ChannelError: the stream ended (also mid-frame) or its length is not a frame's.
    """
    try:
        (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if n > MAX_FRAME_BYTES:
            raise ChannelError(f"a frame of {n} bytes: the stream is broken")
        return pickle.loads(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise ChannelError("the stream ended") from None


def write_frame(writer: asyncio.StreamWriter, messages: list[Any]) -> None:
    """Write ``messages`` as one frame (nothing if the stream is closing)."""
    if not writer.is_closing():
        data = pickle.dumps(messages, pickle.HIGHEST_PROTOCOL)
        writer.write(_LENGTH.pack(len(data)) + data)


class Outbox:
    """Messages for the peer, written as one frame at the end of the current loop turn
    (whatever the turn put here: nothing waits for a batch to fill)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        if not self.items:
            asyncio.get_running_loop().call_soon(self.flush)
        self.items.append(item)

    def flush(self) -> None:
        items, self.items = self.items, []
        if items:
            write_frame(self.writer, items)
