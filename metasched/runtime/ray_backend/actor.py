"""The dispatcher as a named, detached Ray actor, so that workers in any process or on
any node submit to one dispatcher.

:class:`DispatcherActor` holds a :class:`~metasched.runtime.dispatch.Dispatcher` on
a :class:`~.cluster.RayBackend`, on the actor's event loop. It is pinned to the node it
was started from (its journal is a file there) and restarted by Ray if its process dies;
the new one recovers the journal as a restarted dispatcher does on one machine (kills
what the dead one left running, re-queues what was unfinished, answers finished ids
from the journal).

Calls are made for throughput. A client sends the requests of one event-loop turn in
one call (:meth:`DispatcherActor.accept_batch`, answered once they are journaled), and
reads its results from one direct connection to the actor
(:meth:`DispatcherActor.open_results`), or, where it cannot reach the actor's address,
from one long-lived streaming call (:meth:`DispatcherActor.results`); either sends
every result that finished since its last frame or yield: a few actor calls per
thousand actions instead of two per action. :mod:`.client` is that client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
from collections.abc import AsyncIterator, Mapping
from typing import Any

import ray

from metasched import __version__
from metasched.core.metrics import RunResult
from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.gpu import LiveService
from metasched.runtime.ray_backend import channel
from metasched.runtime.ray_backend.cluster import DEFAULT_SUBMIT, RayBackend
from metasched.runtime.requests import REJECTED, Result

log = logging.getLogger("metasched.dispatch")


# A stream yields at most this often: results that finish within one interval go in one
# yield. Each yield costs about 0.4 ms of the actor's CPU and 0.6 ms of the reader's
# (measured: an object, an RPC, a wake-up of the reader's loop), more than the rest of a
# no-op action's journey through the handle, so results are sent one per yield only
# while they come slower than this: a result waits at most this long, and only while
# another was sent within the last interval.
YIELD_INTERVAL_S = 0.02
# Results sent on a client's direct connection (:meth:`DispatcherActor.open_results`)
# go at most this often: a frame costs tens of µs, so results wait far less.
FRAME_INTERVAL_S = 0.002
OPEN_RESULTS_S = 60.0  # how long a client has to connect once it asked to


class ResultBox:
    """Finished results waiting for the next yield of a results stream, which yields at
    most every ``interval_s`` (whatever finished meanwhile, in one batch)."""

    __slots__ = ("items", "ready", "last", "interval_s")

    def __init__(self, interval_s: float) -> None:
        self.items: list[Any] = []
        self.ready = asyncio.Event()
        self.last = 0.0  # when the stream last yielded (loop time)
        self.interval_s = interval_s

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[Any]:
        await self.ready.wait()
        loop = asyncio.get_running_loop()
        wait = self.last + self.interval_s - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self.ready.clear()
        self.last = loop.time()
        out, self.items = self.items, []
        return out


class ResultBoxes:
    """Each client's :class:`ResultBox`, made on first use and dropped once the reader
    that took from it has ended with nothing left in it."""

    __slots__ = ("_boxes", "interval_s")

    def __init__(self, interval_s: float) -> None:
        self._boxes: dict[str, ResultBox] = {}
        self.interval_s = interval_s

    def __len__(self) -> int:
        return len(self._boxes)

    def get(self, client: str) -> ResultBox:
        """``client``'s box (a new one if it has none)."""
        box = self._boxes.get(client)
        if box is None:
            box = self._boxes[client] = ResultBox(self.interval_s)
        return box

    def done_with(self, client: str, box: ResultBox) -> None:
        """``box``'s reader ended: drop it if it is still ``client``'s and empty (a
        result put after this makes a new box for the next reader)."""
        if self._boxes.get(client) is box and not box.items:
            del self._boxes[client]


def dumps(obj: Any) -> bytes:
    """``obj`` as bytes for an actor call: bytes pass through Ray without its serializer,
    which costs several times a pickle of lists of requests and results (paid on every
    action). Values plain pickle cannot hold (a GPU service's, a callable) go through
    cloudpickle, which ``pickle.loads`` reads too."""
    try:
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        from ray import cloudpickle

        return cloudpickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


class DispatcherActor:
    """A dispatcher on the Ray cluster (see the module docstring). Started by
    :func:`metasched.runtime.ray_backend.start_dispatcher`, not directly.

    Args:
        config: the dispatcher's settings (``cores``, ``mem_gb``, ``gpu_standin`` do not
            apply: the cluster says what it has).
        services: GPU services by name (each GPU's actor hosts them).
        name: the actor's name (commands carry it; see :class:`~.cluster.RayBackend`).
        cores_per_node: grant at most this many cores per node (default: all Ray has).
        submit: how commands reach their node's daemon (see :class:`~.cluster.RayBackend`).
    """

    def __init__(self, config: DispatcherConfig, services: Mapping[str, LiveService] | None,
                 name: str, cores_per_node: int | None = None,
                 submit: str = DEFAULT_SUBMIT) -> None:
        self.config = config
        self.services = dict(services or {})
        self.name = name
        self.cores_per_node = cores_per_node
        self.submit = submit
        self.dispatcher: Dispatcher | None = None
        self.backend: RayBackend | None = None
        self._starting: asyncio.Task | None = None
        self._boxes = ResultBoxes(YIELD_INTERVAL_S)

    async def _ready(self) -> Dispatcher:
        if self.dispatcher is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            await asyncio.shield(self._starting)
        return self.dispatcher

    async def _start(self) -> None:
        cfg = self.config
        self.backend = await RayBackend.create(
            dispatcher=self.name, services=self.services, cores_per_node=self.cores_per_node,
            standin_mem_gb=cfg.gpu_standin_mem_gb, workdir=cfg.workdir, submit=self.submit)
        d = Dispatcher(cfg, backend=self.backend)
        await d.start()
        self.dispatcher = d

    # --------------------------------------------------------------- calls

    async def ready(self) -> dict[str, Any]:
        """Start the dispatcher (once); where it runs and what it schedules over."""
        try:
            d = await self._ready()
        except ConfigError as e:
            self._starting = None  # a later call tries again
            return {"error": str(e)}
        c = d.cluster
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "nodes": c.cpu_nodes, "cores_per_node": c.cores_per_node,
                "gpus": c.gpu_devices, "endpoints": sorted(c.endpoints),
                "scheduler": d.scheduler.name if d.scheduler else None,
                "recovered": d.state.n_submitted,
                # What a client attaching by name checks it against (metasched-dispatch,
                # metasched-serve: see metasched.runtime.ray_backend.remote).
                "version": __version__, "settings": {
                    "scheduler": self.config.scheduler, "journal": str(self.config.journal)
                    if self.config.journal is not None else None,
                    "submit": self.submit, "cores_per_node": self.cores_per_node}}

    async def submit(self, request: Any, call: Any = None) -> Result:
        """One request; its result (a rejection for bad input, never an exception)."""
        d = await self._ready()
        return await d.submit(request, call=call)

    async def accept_batch(self, client: str, packed: bytes,
                           calls: Mapping[int, Any] | None = None) -> bytes:
        """Accept the requests of ``packed`` (:func:`dumps` of a list); each result goes
        to ``client``'s stream (:meth:`results`).

        Returns, :func:`dumps`'d, per request, None once it is durable (journaled, when
        there is a journal), or its result when it has one already (rejected, or a
        finished id answered from the journal): those go to no stream.
        """
        d = await self._ready()
        requests: list[Any] = pickle.loads(packed)
        box = self._boxes.get(client)
        calls = calls or {}
        acks: list[Result | None] = []
        futures = []
        for i, req in enumerate(requests):
            fut = d.accept(req, call=calls.get(i))
            if fut.done():
                acks.append(fut.result())
            else:
                acks.append(None)
                fut.add_done_callback(lambda f, box=box: _deliver(f, box))
                futures.append(fut)
        if futures and d.journal is not None:
            d.flush()  # durable before acknowledged (as Dispatcher.enqueue)
            # A flush can answer ids the journal holds finished: they are in the stream.
        return dumps(acks)

    async def results(self, client: str) -> AsyncIterator[bytes]:
        """``client``'s results, in batches (each a :func:`dumps`'d list), as they finish
        (a streaming call)."""
        box = self._boxes.get(client)
        try:
            while True:
                yield dumps(await box.take())
        finally:
            self._boxes.done_with(client, box)

    async def open_results(self, client: str, secret: bytes) -> tuple[str, int]:
        """Listen, on this node's address, for ``client``'s results stream: a direct
        connection (see :mod:`.channel`) on which its results go as frames, each a
        pickled list, every :data:`FRAME_INTERVAL_S` at most, instead of the yields of
        :meth:`results` (a frame costs tens of µs of this process's CPU, a yield about
        0.4 ms). Only a peer that proves it holds ``secret`` is served; the address
        and port (one connection: the listener closes once it is served)."""
        host = ray.util.get_node_ip_address()
        box = self._boxes.get(client)
        server = await asyncio.start_server(
            lambda r, w: self._serve_results(client, secret, box, server, r, w), host, 0)
        # A client that never comes (it died meanwhile) leaves no listener behind.
        asyncio.get_running_loop().call_later(OPEN_RESULTS_S, server.close)
        return host, server.sockets[0].getsockname()[1]

    async def _serve_results(self, client: str, secret: bytes, box: ResultBox,
                             server: asyncio.Server, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        if not await channel.serve_challenge(reader, writer, secret):
            writer.close()
            return
        server.close()  # one client, one connection
        box.interval_s = FRAME_INTERVAL_S
        serving = asyncio.current_task()
        # The client sends nothing on it: its end (EOF) ends the serving, between frames
        # (a cancel while waiting for results takes none of them).
        ended = asyncio.ensure_future(reader.read())
        ended.add_done_callback(lambda f: _end(f, serving))
        try:
            while not writer.is_closing():
                channel.write_frame(writer, await box.take())
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went: what it was not sent, it submits again
        finally:
            ended.cancel()
            writer.close()
            self._boxes.done_with(client, box)

    async def stats(self) -> dict[str, Any]:
        """The dispatcher's counters (as :meth:`Dispatcher.stats`), and its process's."""
        d = await self._ready()
        return {**d.stats(), "backend": "ray", "actor_pid": os.getpid(),
                "nodes": d.cluster.cpu_nodes, "cores_per_node": d.cluster.cores_per_node,
                "clients": len(self._boxes)}

    async def status(self) -> dict[str, Any]:
        """The dispatcher's status (as :meth:`Dispatcher.status`: the pools now)."""
        d = await self._ready()
        return {**d.status(), "backend": "ray"}

    async def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands (as :meth:`Dispatcher.find`)."""
        return (await self._ready()).find(rid)

    async def close_trajectory(self, name: str) -> None:
        """End trajectory ``name`` (as :meth:`Dispatcher.close_trajectory`)."""
        (await self._ready()).close_trajectory(name)

    async def run_result(self) -> RunResult:
        """What the dispatcher measured, in the simulator's form."""
        d = await self._ready()
        return d.run_result()

    async def flush(self) -> None:
        (await self._ready()).flush()

    async def close(self, drain: bool = True) -> dict[str, Any]:
        """Stop the dispatcher (with ``drain``, after every accepted request has
        finished); the actor can then be killed. Returns its final stats."""
        d = await self._ready()
        await d.close(drain=drain)
        stats = d.stats()
        if self.backend is not None:
            await self.backend.close()
        return stats


def _end(reading: asyncio.Future, serving: asyncio.Task) -> None:
    """A client's connection ended (EOF, or reset): stop serving it."""
    if not reading.cancelled():
        reading.exception()  # retrieved: a reset is how connections end too
    serving.cancel()


def _deliver(future: asyncio.Future, box: ResultBox) -> None:
    if future.cancelled():  # the dispatcher closed without draining: it is unfinished
        return
    box.put(future.result())


__all__ = ["REJECTED", "DispatcherActor", "dumps"]
