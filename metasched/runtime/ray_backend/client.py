"""Starting the dispatcher actor, and the handle workers submit through.

:func:`start_dispatcher` starts the named, detached dispatcher actor (or finds the one
already running under that name); :func:`connect` finds it from any process of the
cluster. Both return a :class:`DispatcherHandle`, with the dispatcher's interface
(``submit``, ``enqueue``, ``accept``, ``stats``) on the caller's event loop, and
``handle.sync()`` for code without one.

The handle sends the requests accepted in one turn of its event loop in one actor call,
and receives results on one direct connection to the actor, or from one streaming call
where the actor's address cannot be reached (see :mod:`.actor`). If the actor dies,
the handle waits for Ray to restart it and submits what it had not been answered again,
under the same ids: with a journal, the restarted dispatcher runs each of them once
more at most (finished ids are answered from the journal, unfinished ones join the
recovered requests).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from metasched.errors import ConfigError
from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.gpu import LiveService
from metasched.runtime.ray_backend import channel
from metasched.runtime.ray_backend.actor import DispatcherActor, dumps
from metasched.runtime.ray_backend.cluster import DEFAULT_SUBMIT, check_submit
from metasched.runtime.ray_backend.commands import lost
from metasched.runtime.requests import REJECTED, Request, Result

log = logging.getLogger("metasched.dispatch")

DEFAULT_NAME = "metasched"
NAMESPACE = "metasched"  # detached actors are found by name within a namespace
RESTART_WAIT_S = 120.0  # how long a handle waits for a restarted actor
# The dispatcher's loop serves every client: calls queue there, not in Ray's thread pool.
MAX_CONCURRENCY = 10_000


def _ensure_ray(address: str | None, namespace: str = NAMESPACE) -> None:
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)


def start_dispatcher(config: DispatcherConfig | None = None, *, name: str = DEFAULT_NAME,
                     services: Mapping[str, LiveService] | None = None,
                     cores_per_node: int | None = None, submit: str = DEFAULT_SUBMIT,
                     address: str | None = None, timeout_s: float = 300.0,
                     namespace: str = NAMESPACE) -> DispatcherHandle:
    """Start the dispatcher actor ``name`` on this node (where its journal is), or find
    the running one, and wait until it serves.

    Args:
        config: the dispatcher's settings (see :class:`DispatcherConfig`; ``journal`` is
            a path on this node).
        name: the actor's name in the ``metasched`` namespace.
        services: GPU services by name (each GPU's actor hosts them).
        cores_per_node: grant at most this many cores per node.
        submit: how commands reach their node's daemon: ``"stream"`` (one direct stream
            per node; the daemons hold the dispatcher's cores in Ray), ``"daemon"`` (an
            actor call per command) or ``"task"`` (a Ray task each, with ``num_cpus``
            of its grant): see :mod:`.cluster`.
        address: the cluster (default ``"auto"``) when Ray is not initialised yet.
        timeout_s: how long the dispatcher may take to start.
        namespace: the Ray namespace the actor's name is found in.

    Raises:
        ConfigError: the dispatcher cannot start on this cluster (one line, naming the
            setting), e.g. a journal another dispatcher holds.
    """
    check_submit(submit)
    _ensure_ray(address, namespace)
    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(DispatcherActor).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=MAX_CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(config or DispatcherConfig(), dict(services or {}), name, cores_per_node, submit)
    info = ray.get(actor.ready.remote(), timeout=timeout_s)
    if "error" in info:
        ray.kill(actor, no_restart=True)
        field, _, message = info["error"].partition(": ")
        raise ConfigError(field, message)
    return DispatcherHandle(actor, name)


def connect(name: str = DEFAULT_NAME, *, address: str | None = None,
            namespace: str = NAMESPACE) -> DispatcherHandle:
    """The handle of the running dispatcher actor ``name`` (from any process or node).

    Raises:
        ConfigError: no dispatcher of that name runs on the cluster.
    """
    _ensure_ray(address, namespace)
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ConfigError("name", f"no dispatcher {name!r} runs on this Ray cluster (start "
                          f"one with metasched.runtime.ray_backend.start_dispatcher)") from None
    return DispatcherHandle(actor, name)


def stop_dispatcher(name: str = DEFAULT_NAME, *, drain: bool = True,
                    timeout_s: float | None = None,
                    namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """Close the dispatcher actor ``name`` (with ``drain``, once everything it accepted
    has finished) and remove it; its final stats, or None if none was running."""
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    try:
        stats = ray.get(actor.close.remote(drain), timeout=timeout_s)
    finally:
        ray.kill(actor, no_restart=True)
    return stats


class _Sent:
    """One submission the handle has not been answered for yet."""

    __slots__ = ("rid", "request", "call", "future", "acked")

    def __init__(self, rid: str, request: Any, call: Any, future: asyncio.Future[Result]
                 ) -> None:
        self.rid = rid
        self.request = request
        self.call = call
        self.future = future
        self.acked: asyncio.Future[None] | None = None  # made by enqueue() to wait on


class DispatcherHandle:
    """A dispatcher actor's client (see the module docstring). One handle serves one
    event loop (the first it is used on); make one per loop, or use :meth:`sync`."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self.client = uuid.uuid4().hex
        self._loop: asyncio.AbstractEventLoop | None = None
        # Unanswered submissions by id (one id may be submitted more than once: the
        # dispatcher answers each, and one result answers every accepted one).
        self._sent: dict[str, list[_Sent]] = {}
        self._batch: list[_Sent] = []  # to send at the end of this loop turn
        self._reader: asyncio.Task | None = None
        self._senders: set[asyncio.Task] = set()
        self._recovering: asyncio.Task | None = None
        # How results come: "direct" (a connection to the actor), "ray" (its results
        # stream, where the actor cannot be reached directly), "" (not read yet).
        self.results_via = ""
        self._direct: asyncio.StreamWriter | None = None  # the connection, while open

    # ------------------------------------------------------------- the interface

    async def submit(self, request: Request | Mapping[str, Any], *, call: Any = None) -> Result:
        """Run one action and return its result (as :meth:`Dispatcher.submit`)."""
        return await self.accept(request, call=call)

    async def enqueue(self, request: Request | Mapping[str, Any], *, call: Any = None
                      ) -> asyncio.Future[Result]:
        """Accept ``request`` and return once the dispatcher has it durably (as
        :meth:`Dispatcher.enqueue`); the future of its result."""
        sent = self._accept(request, call)
        if sent.acked is not None:
            await asyncio.shield(sent.acked)
        return sent.future

    def accept(self, request: Request | Mapping[str, Any], *, call: Any = None
               ) -> asyncio.Future[Result]:
        """Accept ``request`` and return the future of its result (as
        :meth:`Dispatcher.accept`: bad input is a rejected result, not an exception)."""
        return self._accept(request, call).future

    def stats(self) -> dict[str, Any]:
        """The dispatcher's counters (a blocking call; ``await astats()`` in a loop)."""
        return ray.get(self.actor.stats.remote())

    async def astats(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    def run_result(self):
        """What the dispatcher measured, in the simulator's form (blocking)."""
        return ray.get(self.actor.run_result.remote())

    def sync(self) -> SyncDispatcherHandle:
        """A blocking handle for code without an event loop (a thread runs this one's)."""
        return SyncDispatcherHandle(self.actor, self.name)

    async def aclose(self) -> None:
        """Stop reading results (pending futures are cancelled)."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        for task in [*self._senders, *([self._recovering] if self._recovering else [])]:
            task.cancel()
        for entries in self._sent.values():
            for sent in entries:
                sent.future.cancel()
        self._sent.clear()

    # ------------------------------------------------------------- internals

    def _accept(self, request: Any, call: Any) -> _Sent:
        loop = self._bind()
        future: asyncio.Future[Result] = loop.create_future()
        if isinstance(request, Request):
            rid = request.id
        elif isinstance(request, Mapping):
            rid = request.get("id")
            if rid is None:  # the id the result comes back under
                rid = uuid.uuid4().hex
                request = {**request, "id": rid}
        else:
            rid = None
        sent = _Sent(rid if isinstance(rid, str) else "", request, call, future)
        if not isinstance(rid, str):  # not sendable under an id: the dispatcher's words
            future.set_result(_not_a_request(request))
            return sent
        sent.acked = loop.create_future()
        self._sent.setdefault(rid, []).append(sent)
        self._batch.append(sent)
        if len(self._batch) == 1:
            loop.call_soon(self._send)
        return sent

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("a DispatcherHandle serves one event loop; make one per loop "
                               "(connect() again) or use handle.sync()")
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read())
        return loop

    def _send(self) -> None:
        batch, self._batch = self._batch, []
        if batch and self._recovering is None:
            task = self._loop.create_task(self._send_batch(batch))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)

    async def _send_batch(self, batch: list[_Sent]) -> None:
        calls = {i: s.call for i, s in enumerate(batch) if s.call is not None}
        try:
            packed = dumps([s.request for s in batch])
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            packed, acks = None, [Result(s.rid, REJECTED, f"request: cannot be sent to the "
                                         f"dispatcher ({e})") for s in batch]
        try:
            if packed is not None:
                acks = pickle.loads(await self.actor.accept_batch.remote(
                    self.client, packed, calls or None))
        except ray.exceptions.RayActorError as e:
            self._recover(e)  # these stay in _sent: sent again once the actor is back
            return
        except ray.exceptions.RayError as e:  # e.g. a callable Ray cannot serialize
            acks = [Result(s.rid, REJECTED, lost(e)) for s in batch]
        for sent, ack in zip(batch, acks, strict=True):
            if sent.acked is not None and not sent.acked.done():
                sent.acked.set_result(None)
            if ack is not None:  # answered at once: this submission alone
                entries = self._sent.get(sent.rid, [])
                if sent in entries:
                    entries.remove(sent)
                    if not entries:
                        del self._sent[sent.rid]
                if not sent.future.done():
                    sent.future.set_result(ack)

    def _answer(self, result: Result) -> None:
        for sent in self._sent.pop(result.id, ()):
            if not sent.future.done():
                sent.future.set_result(result)

    async def _read(self) -> None:
        """Deliver results from a direct connection to the actor (or, if its address
        cannot be reached from here, from its results stream); after a restart, or if
        the connection breaks, connect again (what was not answered is sent again)."""
        while True:
            try:
                reader, writer = await self._connect()
            except ray.exceptions.RayActorError as e:
                self._recover(e)
                recovering = self._recovering
                if recovering is not None:
                    await recovering
                continue
            except (OSError, channel.ChannelError) as e:
                log.info("dispatcher %s: no direct connection (%s): results come through "
                         "Ray", self.name, e)
                await self._read_stream()
                return
            self.results_via, self._direct = "direct", writer
            try:
                while True:
                    for result in await channel.read_frame(reader):
                        self._answer(result)
            except (channel.ChannelError, ConnectionError) as e:
                writer.close()
                self._direct = None
                self._recover(e)
                recovering = self._recovering
                if recovering is not None:
                    await recovering
            except asyncio.CancelledError:
                writer.close()
                raise

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The direct connection to the actor's results (see
        :meth:`DispatcherActor.open_results`)."""
        try:
            opener = self.actor.open_results
        except AttributeError:  # an actor that offers only the stream (a shard's)
            raise channel.ChannelError("the actor sends results through Ray only") from None
        secret = channel.new_secret()
        host, port = await opener.remote(self.client, secret)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await channel.answer_challenge(reader, writer, secret)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _read_stream(self) -> None:
        """Deliver results from the actor's results stream; after a restart, open a new
        one."""
        self.results_via = "ray"
        while True:
            stream = self.actor.results.options(num_returns="streaming").remote(self.client)
            try:
                async for ref in stream:
                    for result in pickle.loads(await ref):
                        self._answer(result)
            except ray.exceptions.RayActorError as e:
                self._recover(e)
                recovering = self._recovering
                if recovering is not None:
                    await recovering
            except ray.exceptions.RayError as e:  # not expected: read again shortly
                log.warning("reading results from dispatcher %s failed (%s)", self.name, lost(e))
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                ray.cancel(stream)
                raise

    def _recover(self, why: BaseException) -> None:
        if self._recovering is None or self._recovering.done():
            log.warning("dispatcher %s unreachable (%s): waiting for it to restart", self.name,
                        lost(why))
            self._recovering = self._loop.create_task(self._resubmit())

    async def _resubmit(self) -> None:
        """Wait for the restarted actor, then send every unanswered request again."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                info = await self.actor.ready.remote()
                break
            except ray.exceptions.RayActorError as e:
                if time.monotonic() > deadline:
                    gone = f"dispatcher {self.name} did not come back within " \
                           f"{RESTART_WAIT_S:g} s: {lost(e)}"
                    for rid in list(self._sent):
                        self._answer(Result(rid, REJECTED, gone))
                    self._recovering = None
                    return
                await asyncio.sleep(0.2)
        pending = [s for entries in self._sent.values() for s in entries]
        log.info("dispatcher %s is back (pid %s): resubmitting %d requests", self.name,
                 info.get("pid"), len(pending))
        self._recovering = None
        self._batch = pending
        self._send()


def _not_a_request(request: Any) -> Result:
    """The dispatcher's rejection of something that is not a request (no id to send)."""
    from metasched.runtime.requests import parse_request

    try:
        parse_request(request)
    except ConfigError as e:
        return Result("", REJECTED, str(e))
    return Result("", REJECTED, "request: must be a mapping with a string id")


class SyncDispatcherHandle:
    """A :class:`DispatcherHandle` for code without an event loop: each call blocks; a
    background thread runs the handle's loop, so calls from many threads are sent
    together as they come."""

    def __init__(self, actor: Any, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"metasched-{name}")
        self._thread.start()
        self._handle = DispatcherHandle(actor, name)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, request: Request | Mapping[str, Any], *, call: Any = None) -> Result:
        """Run one action; its result."""
        return self._run(self._handle.submit(request, call=call))

    def map(self, requests: list[Request | Mapping[str, Any]]) -> list[Result]:
        """Run ``requests`` together; their results, in order."""
        async def all_of() -> list[Result]:
            return list(await asyncio.gather(*(self._handle.accept(r) for r in requests)))
        return self._run(all_of())

    def stats(self) -> dict[str, Any]:
        return self._handle.stats()

    def close(self) -> None:
        """Stop the background loop (unanswered calls are cancelled)."""
        self._run(self._handle.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> SyncDispatcherHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_NAME", "NAMESPACE", "DispatcherHandle", "SyncDispatcherHandle", "connect",
           "start_dispatcher", "stop_dispatcher"]
