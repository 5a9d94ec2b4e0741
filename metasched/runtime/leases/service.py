"""The lease service: one Ray actor that grants the shared pools (API quotas, GPU
service slots) to every dispatcher shard as leases (:mod:`.book` says what a lease is
and why no quota is exceeded), and :class:`LeaseClient`, what a shard asks it through.

The actor is named and detached, pinned to the node its file is on, and restarted by
Ray when its process dies (``kill -9`` included): the new one reads the file back, and
a call that was in flight is retried by Ray on it (an ``acquire`` retried under the
same key gets the leases the lost answer held). Its holders renew what they hold every
third of the TTL; a renewal the restarted service does not know re-presents the lease.
While the service is down a client waits (``acquire``) or keeps what it holds (a
lease's call that is running goes on: it was counted when granted).

Times cross the wire as durations (``expires_in``, ``retry_in``), never as clock
readings: a holder on another node keeps its own clock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from metasched.runtime.leases.book import LeaseBook, PoolLimit

log = logging.getLogger("metasched.leases")

__all__ = ["LEASE_SERVICE", "LeaseClient", "LeaseService", "Ticket", "start_lease_service"]

LEASE_SERVICE = "metasched-leases"
NAMESPACE = "metasched"
# A client asks again at least this often while a pool is full (a release elsewhere, or
# another shard's lapse, frees room before the service's ``retry_in``).
POLL_S = 0.25
# A lease is sent under only while this much of its TTL is left (the call reaches its
# upstream well within it).
SEND_MARGIN_S = 0.5
# A spare lease (see LeaseClient's ``block``) unused for this long goes back.
SPARE_S = 1.0


class LeaseService:
    """The actor (see the module docstring). Started by :func:`start_lease_service`.

    Args:
        pools: each shared pool's limit, by name.
        ttl_s: a lease's life unless renewed.
        path: the file the book appends to (None: a restart forgets every lease, and
            quotas hold across it only for leases holders re-present).
    """

    def __init__(self, pools: Mapping[str, PoolLimit], ttl_s: float = 5.0,
                 path: str | None = None) -> None:
        self.book = LeaseBook(dict(pools), ttl_s=ttl_s, path=path)
        self.started = time.time()
        self.calls = 0
        if self.book.restored:
            log.info("lease service restarted: %d leases read back", self.book.restored)

    def ping(self) -> dict[str, Any]:
        """Where it runs, since when, and what it read back at its start."""
        times = os.times()
        return {"pid": os.getpid(), "started": self.started, "restored": self.book.restored,
                "pools": sorted(self.book.pools), "cpu_s": times.user + times.system}

    def acquire(self, holder: str, pool: str, n: int = 1, tokens: float = 0.0,
                ask: str = "") -> dict[str, Any]:
        """Up to ``n`` leases (see :meth:`LeaseBook.acquire`): ``{"leases": [(id,
        expires_in)], "retry_in": s | None}``, or ``{"error": line}``."""
        self.calls += 1
        try:
            g = self.book.acquire(holder, pool, n, tokens, ask)
        except ValueError as e:  # ConfigError: a one-line answer, not a traceback
            return {"error": str(e)}
        now = self.book.clock()
        return {"leases": [(x.id, x.expires - now) for x in g.leases],
                "retry_in": None if g.retry_at is None else max(0.0, g.retry_at - now)}

    def release(self, ids: list[str]) -> int:
        self.calls += 1
        return self.book.release(ids)

    def renew(self, holder: str, leases: list[tuple[str, str, float]]) -> int:
        self.calls += 1
        return self.book.renew(holder, leases)

    def load(self) -> dict[str, Any]:
        """Per pool, leases held and calls in the window; the calls served so far."""
        return {"pools": self.book.load(), "calls": self.calls, "grants": self.book.grants}


def start_lease_service(pools: Mapping[str, PoolLimit], *, name: str = LEASE_SERVICE,
                        ttl_s: float = 5.0, path: str | None = None,
                        namespace: str = NAMESPACE, timeout_s: float = 60.0) -> Any:
    """Start the lease service ``name`` on this node (where ``path`` is), or find the
    running one; its actor handle once it answers."""
    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(LeaseService).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(dict(pools), ttl_s, path)
    ray.get(actor.ping.remote(), timeout=timeout_s)
    return actor


@dataclass
class Ticket:
    """One lease a client holds: send its call only while :meth:`usable`."""

    id: str
    pool: str
    tokens: float
    deadline: float  # this process's monotonic clock: the lease's expiry, less a margin

    def usable(self) -> bool:
        return time.monotonic() < self.deadline


class LeaseClient:
    """A shard's side of the lease service: ``await acquire(pool)`` for a
    :class:`Ticket`, ``release(ticket)`` when its call is done; what it holds is renewed
    in the background (every third of the TTL). Survives the service's restarts: calls
    are retried until it answers again.

    Args:
        service: the lease service's actor handle.
        holder: this client's name (a shard's).
        ttl_s: the service's lease TTL.
        block: leases asked per call (the spare ones are handed to the next acquires
            of the pool while usable, and given back unused after ``SPARE_S``): fewer
            calls to the service, at the price of quota idle in a shard's hands.
    """

    def __init__(self, service: Any, holder: str, ttl_s: float = 5.0, block: int = 1) -> None:
        self.service = service
        self.holder = holder
        self.ttl_s = ttl_s
        self.block = block
        self.spare: dict[str, list[tuple[float, Ticket]]] = {}  # pool -> (got at, ticket)
        self.held: dict[str, Ticket] = {}
        self._releases: list[str] = []
        self._renewer: asyncio.Task | None = None
        self._flushing: asyncio.Future | None = None
        self.waits = 0  # service calls answered "full"
        self.outages = 0  # calls that found the service down

    async def _call(self, method: str, *args: Any) -> Any:
        """One service call, retried while the service restarts."""
        delay = 0.05
        while True:
            try:
                return await getattr(self.service, method).remote(*args)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self.outages += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def acquire(self, pool: str, tokens: float = 0.0) -> Ticket:
        """A lease of ``pool`` (waits while the pool is full or the service is down).

        Raises:
            ValueError: no such pool, or more tokens than the pool's window allows.
        """
        if self._renewer is None:
            self._renewer = asyncio.ensure_future(self._renew_loop())
        spare = self.spare.get(pool)
        while spare:
            t = spare.pop()[1]
            if t.tokens == tokens and t.usable():
                return t
            self.release(t)
        ask = uuid.uuid4().hex
        while True:
            if self._releases:
                await self.flush()
            sent = time.monotonic()
            r = await self._call("acquire", self.holder, pool, self.block, tokens, ask)
            if "error" in r:
                raise ValueError(r["error"])
            if r["leases"]:
                got = [Ticket(lid, pool, tokens, sent + expires_in - SEND_MARGIN_S)
                       for lid, expires_in in r["leases"]]
                for t in got:
                    self.held[t.id] = t
                self.spare.setdefault(pool, []).extend((sent, t) for t in got[1:])
                return got[0]
            self.waits += 1
            retry = r["retry_in"]
            await asyncio.sleep(POLL_S if retry is None else min(max(retry, 0.001), POLL_S))

    def release(self, ticket: Ticket) -> None:
        """``ticket``'s call is done: its lease goes back at the next flush (the next
        acquire, or the renewal loop's turn)."""
        if self.held.pop(ticket.id, None) is not None:
            self._releases.append(ticket.id)
            if self._flushing is None or self._flushing.done():
                # Sent now: the book counts a call until its release reaches it.
                self._flushing = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        while self._releases:
            ids, self._releases = self._releases, []
            await self._call("release", ids)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.ttl_s / 3, 1.0))
            try:
                now = time.monotonic()
                for spare in self.spare.values():
                    old = [t for got, t in spare if now - got > SPARE_S]
                    spare[:] = [(got, t) for got, t in spare if now - got <= SPARE_S]
                    for t in old:
                        self.release(t)
                await self.flush()
                if self.held:
                    sent = time.monotonic()
                    held = list(self.held.values())
                    await self._call("renew", self.holder,
                                     [(t.id, t.pool, t.tokens) for t in held])
                    for t in held:
                        t.deadline = sent + self.ttl_s - SEND_MARGIN_S
            except Exception:  # noqa: BLE001 - the loop must outlive one bad call
                log.exception("lease renewal failed")

    async def close(self) -> None:
        """Give back what is held."""
        if self._renewer is not None:
            self._renewer.cancel()
        self._releases.extend(self.held)
        self.held.clear()
        self.spare.clear()
        await self.flush()
