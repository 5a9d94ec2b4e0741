"""Commands on a Ray node, as the dispatcher holds them: :class:`RemoteCommand` (a Ray
task or an daemon call, ``submit="task"`` or ``"daemon"``), :class:`StreamedCommand` (sent
on the node's stream, ``submit="stream"``) and :class:`NodeLink`, that stream; and
:func:`lost`, why a Ray task or call failed, on one line.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from typing import Any

import ray

from metasched.runtime.outcome import Outcome
from metasched.runtime.ray_backend import channel


class RemoteCommand:
    """A command running on a Ray node (the :class:`~metasched.runtime.backend.Command`
    of a Ray backend): ``wait()`` awaits its task or daemon call; cancelling the wait, or
    ``abandon()``, cancels it (its process group is killed on the node, or it leaves
    the node's queue). ``cores`` are the node's to choose: empty until its Outcome
    (``detail["cores"]``) says."""

    __slots__ = ("ref", "cores")

    def __init__(self, ref: ray.ObjectRef, cores: list[int] | None = None) -> None:
        self.ref = ref
        self.cores = list(cores or [])

    async def wait(self) -> Outcome:
        try:
            out = pickle.loads(await self.ref)
        except asyncio.CancelledError:
            ray.cancel(self.ref)
            raise
        except ray.exceptions.RayError as e:
            return Outcome(ok=False, reason=lost(e), detail={"cores": self.cores})
        self.cores = list(out.detail.get("cores", self.cores))
        return out

    def abandon(self) -> None:
        ray.cancel(self.ref)


class StreamedCommand:
    """A command sent on its node's stream (``submit="stream"``): ``wait()`` awaits its
    result from the stream, or ``then(callback)`` has the stream call ``callback`` with
    it as it reads it (no task, no loop turn of its own: what the dispatcher does for
    each of thousands of commands a second); cancelling the wait, or ``abandon()``,
    cancels it there."""

    __slots__ = ("link", "key", "future", "cores")

    def __init__(self, link: NodeLink, key: int, future: asyncio.Future[Outcome]) -> None:
        self.link, self.key, self.future = link, key, future
        self.cores: list[int] = []

    async def wait(self) -> Outcome:
        try:
            out = await self.future
        except asyncio.CancelledError:
            self.link.cancel(self.key)
            raise
        self.cores = list(out.detail.get("cores", self.cores))
        return out

    def then(self, callback: Callable[[Outcome], None]) -> None:
        """Call ``callback(outcome)`` when the command ends, instead of a ``wait()``
        (on the loop, as the stream reads its result; at the next loop turn if it has
        one already)."""
        if self.future.done():
            asyncio.get_running_loop().call_soon(callback, self.future.result())
        else:
            self.link.waiting[self.key] = callback

    def abandon(self) -> None:
        self.link.cancel(self.key)


class NodeLink:
    """The dispatcher's stream to one node's daemon (``submit="stream"``, see
    :mod:`.channel`): commands go as ``("start", key, pack(...))``, results come back as
    ``(key, pickled Outcome)``. If the stream breaks (the daemon or its node is lost),
    every command waiting on it fails with the reason."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.out = channel.Outbox(writer)
        # By key: the future of a command's Outcome, or the callback to hand it to.
        self.waiting: dict[int, asyncio.Future[Outcome] | Callable[[Outcome], None]] = {}
        self.next_key = 0
        self.broken = ""  # why the stream ended ("" while it works)
        self.reader = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def connect(cls, daemon: Any) -> NodeLink:
        """Open ``daemon``'s stream: the daemon listens, this side answers its challenge.

        Raises:
            ConnectionError: the daemon's address cannot be reached (or it refused).
        """
        secret = channel.new_secret()
        host, port = await daemon.open_stream.remote(secret)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await channel.answer_challenge(reader, writer, secret)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    def start(self, packed: bytes) -> StreamedCommand:
        key = self.next_key
        self.next_key += 1
        fut = asyncio.get_running_loop().create_future()
        if self.broken:
            fut.set_result(Outcome(ok=False, reason=self.broken))
        else:
            self.waiting[key] = fut
            self.out.put(("start", key, packed))
        return StreamedCommand(self, key, fut)

    def cancel(self, key: int) -> None:
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            if isinstance(waiter, asyncio.Future):
                waiter.cancel()
            self.out.put(("cancel", key))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                for key, data in await channel.read_frame(reader):
                    _hand(self.waiting.pop(key, None), data)
        except (channel.ChannelError, ConnectionError) as e:
            self.fail(f"ray: lost the node's daemon ({e})")

    def fail(self, why: str) -> None:
        """Every command waiting on this node ends failed with ``why``."""
        self.broken = self.broken or why
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            _hand(waiter, Outcome(ok=False, reason=why))

    async def close(self) -> None:
        self.out.flush()
        self.writer.close()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        self.fail("the dispatcher closed")


def _hand(waiter: asyncio.Future[Outcome] | Callable[[Outcome], None] | None,
          out: Outcome | bytes) -> None:
    """A command's Outcome (or its pickle) to what waits for it."""
    if waiter is None:
        return
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            waiter.set_result(pickle.loads(out) if isinstance(out, bytes) else out)
    else:
        waiter(pickle.loads(out) if isinstance(out, bytes) else out)


def lost(e: BaseException) -> str:
    """Why a task or actor call failed in Ray, on one line."""
    text = " ".join(str(e).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"ray: {type(e).__name__}: {text}" if text else f"ray: {type(e).__name__}"


__all__ = ["NodeLink", "RemoteCommand", "StreamedCommand", "lost"]
