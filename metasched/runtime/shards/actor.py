"""One dispatcher shard: a whole :class:`~metasched.runtime.dispatch.Dispatcher` in a
Ray actor, over its own nodes' CPU pools (the Ray nodes whose ids hash to it), with its
own journal (``<journal_dir>/<name>.sqlite``), asking the lease service for the shared
pools (API quotas; a shard's dispatcher has no GPU of its own).

Its calls are the dispatcher actor's (:class:`~metasched.runtime.ray_backend.actor.
DispatcherActor`: ``accept_batch`` and a ``results`` stream per client), so a
:class:`~metasched.runtime.ray_backend.client.DispatcherHandle` drives it. A shard
also *adopts* a dead shard (:meth:`ShardActor.adopt`): it opens a second dispatcher on
the dead one's journal, which recovers it as a restarted dispatcher does (finished ids
answered from the journal, unfinished ones queued again, their leftover commands
killed on the nodes), and serves the clients that were the dead shard's.

An API request on a shared pool waits for a lease before it is accepted, and gives the
lease back when its result comes: the shard's own dispatcher keeps the endpoint's
quota too (the same figures), which the lease bounds already.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import ray

from metasched import __version__
from metasched.errors import ConfigError
from metasched.runtime.backend import Node
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.leases.service import LEASE_SERVICE, NAMESPACE, LeaseClient
from metasched.runtime.ray_backend.actor import (
    YIELD_INTERVAL_S,
    ResultBox,
    ResultBoxes,
    dumps,
)
from metasched.runtime.ray_backend.cluster import DEFAULT_SUBMIT, RayBackend, cluster_view
from metasched.runtime.requests import Request, Result, parse_request
from metasched.runtime.shards.ring import ShardRing
from metasched.runtime.shards.standin import StandinBackend

__all__ = ["ShardActor", "journal_of"]


def journal_of(journal_dir: str | None, shard: str) -> str | None:
    """The journal of shard ``shard`` (None: shards without journals)."""
    return None if journal_dir is None else str(Path(journal_dir) / f"{shard}.sqlite")


class ShardActor:
    """A dispatcher shard (see the module docstring). Started by
    :func:`metasched.runtime.shards.start_shards`.

    Args:
        name: the shard's name (its actor's, its journal's, its lease holder's).
        config: the dispatcher's settings (its ``journal`` is set from ``journal_dir``).
        journal_dir: where every shard's journal is (shared by the shards that may
            adopt one another: one node, or a shared volume); None: no journals.
        standin: stand-in nodes (``{"nodes": n, "cores": k}``: commands end at once,
            nothing runs) instead of the Ray cluster's nodes.
        shared: the endpoints whose quota, and the GPU services whose slots, the lease
            service holds.
        lease_ttl_s: the lease service's TTL.
        submit: how commands reach the nodes' daemons (see
            :class:`~metasched.runtime.ray_backend.cluster.RayBackend`).
        yield_s: a results stream yields at most this often (shorter: results sooner,
            for about 0.4 ms of the shard's CPU per yield).
        shards: every shard started with this one (the Ray nodes are split among them
            by hashing; default: this one alone).
        lease_block: leases asked per call to the lease service (see
            :class:`~metasched.runtime.leases.service.LeaseClient`).
    """

    def __init__(self, name: str, config: DispatcherConfig, journal_dir: str | None,
                 standin: Mapping[str, Any] | None = None, shared: tuple[str, ...] = (),
                 lease_ttl_s: float = 5.0, submit: str = DEFAULT_SUBMIT,
                 yield_s: float = YIELD_INTERVAL_S, shards: tuple[str, ...] = (),
                 lease_block: int = 1) -> None:
        self.lease_block = lease_block
        self.yield_s = yield_s
        self.shards = tuple(shards) or (name,)
        self.name = name
        self.config = config
        self.journal_dir = journal_dir
        self.standin = dict(standin) if standin is not None else None
        self.shared = frozenset(shared)
        self.lease_ttl_s = lease_ttl_s
        self.submit_mode = submit
        self.dispatchers: dict[str, Dispatcher] = {}  # by the shard whose journal it is
        self._starting: dict[str, asyncio.Future] = {}
        self._boxes = ResultBoxes(yield_s)
        self._owner_of: dict[str, str] = {}  # client -> the shard it was a client of
        self._leases: LeaseClient | None = None
        self.lease_waits = 0

    # ---------------------------------------------------------------- dispatchers

    async def _dispatcher(self, owner: str) -> Dispatcher:
        d = self.dispatchers.get(owner)
        if d is not None:
            return d
        fut = self._starting.get(owner)
        if fut is None:
            fut = self._starting[owner] = asyncio.ensure_future(self._open(owner))
        try:
            return await asyncio.shield(fut)
        except BaseException:
            self._starting.pop(owner, None)  # a later call tries again
            raise

    async def _open(self, owner: str) -> Dispatcher:
        cfg = self.config.replace(journal=journal_of(self.journal_dir, owner))
        if self.standin is not None:
            backend: Any = StandinBackend(owner, **self.standin)
        else:
            backend = RayBackend(await self._nodes_of(owner), None, dispatcher=owner,
                                 workdir=cfg.workdir, submit=self.submit_mode)
        d = Dispatcher(cfg, backend=backend)
        await d.start()
        self.dispatchers[owner] = d
        return d

    async def _nodes_of(self, owner: str) -> list[Node]:
        """The Ray nodes shard ``owner`` schedules over: each node goes to the shard its
        id hashes to among all the shards started together (so an adopter takes over
        exactly the dead shard's nodes)."""
        ring = ShardRing(self.shards)
        nodes = [n for n in await cluster_view() if ring.hashed(n.name) == owner]
        if not nodes:
            raise ConfigError("shards", f"{owner} has no Ray node: fewer nodes than "
                              f"shards ({len(self.shards)}); start fewer shards")
        return nodes

    def _lease_client(self) -> LeaseClient:
        if self._leases is None:
            service = ray.get_actor(LEASE_SERVICE, namespace=NAMESPACE)
            self._leases = LeaseClient(service, self.name, self.lease_ttl_s,
                                       self.lease_block)
        return self._leases

    # ---------------------------------------------------------------- calls

    async def ready(self) -> dict[str, Any]:
        """Start the shard's dispatcher (once); where it runs."""
        try:
            d = await self._dispatcher(self.name)
        except ConfigError as e:
            return {"error": str(e)}
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "shard": self.name, "nodes": d.cluster.cpu_nodes,
                "recovered": d.state.n_submitted, "version": __version__,
                "adopted": sorted(set(self.dispatchers) - {self.name})}

    async def adopt(self, owner: str, client: str | None = None) -> dict[str, Any]:
        """Take over dead shard ``owner``: its journal (recovered) and, with ``client``,
        that client's requests from now on. Returns what was recovered."""
        if client is not None:
            self._owner_of[client] = owner
        d = await self._dispatcher(owner)
        return {"shard": self.name, "adopted": owner, "recovered": d.state.n_submitted}

    async def accept_batch(self, client: str, packed: bytes,
                           calls: Mapping[int, Any] | None = None) -> bytes:
        """As :meth:`DispatcherActor.accept_batch`, on the dispatcher of the shard this
        client is a client of (this one, or one this shard adopted)."""
        d = await self._dispatcher(self._owner_of.get(client, self.name))
        requests: list[Any] = pickle.loads(packed)
        box = self._boxes.get(client)
        calls = calls or {}
        acks: list[Result | None] = []
        journaled = False
        for i, req in enumerate(requests):
            if self.shared and self._on_shared_pool(req):
                req = self._parsed(req)
                if isinstance(req, Request):
                    acks.append(None)
                    asyncio.ensure_future(self._leased(d, req, calls.get(i), box))
                    continue
            fut = d.accept(req, call=calls.get(i))
            if fut.done():
                acks.append(fut.result())
            else:
                acks.append(None)
                fut.add_done_callback(lambda f, box=box: _deliver(f, box))
                journaled = True
        if journaled and d.journal is not None:
            d.flush()  # durable before acknowledged (as Dispatcher.enqueue)
        return dumps(acks)

    def _on_shared_pool(self, req: Any) -> bool:
        """Whether ``req`` is an API call or a GPU service's request on a shared pool
        (read before it is parsed: only those are parsed here; the rest as the
        dispatcher parses them)."""
        get = req.get if isinstance(req, Mapping) else lambda k: getattr(req, k, None)
        pool = {"api": "endpoint", "gpu": "service"}.get(get("kind"))
        return pool is not None and get(pool) in self.shared

    @staticmethod
    def _parsed(req: Any) -> Any:
        if isinstance(req, Mapping):
            try:
                return parse_request(req)
            except ConfigError:
                return req  # the dispatcher rejects it, in its words
        return req

    async def _leased(self, d: Dispatcher, req: Request, call: Any, box: ResultBox) -> None:
        """Run ``req`` under a lease of its pool: an API call's endpoint quota, a GPU
        request's service slots (held from its grant until its result)."""
        leases = self._lease_client()
        try:
            if req.kind == "api":
                ticket = await leases.acquire(req.endpoint, float(req.tokens))
            else:
                ticket = await leases.acquire(req.service)
        except ValueError as e:
            box.put(Result(req.id, "rejected", str(e)))
            return
        try:
            result = await d.accept(req, call=call)
        finally:
            leases.release(ticket)
        box.put(result)

    async def results(self, client: str) -> AsyncIterator[bytes]:
        """``client``'s results, in batches, as they finish (a streaming call)."""
        box = self._boxes.get(client)
        try:
            while True:
                yield dumps(await box.take())
        finally:
            self._boxes.done_with(client, box)

    async def stats(self) -> dict[str, Any]:
        """Per dispatcher it runs (its own, adopted ones), its counters; the process's
        CPU seconds; the lease client's waits and outages."""
        out = {name: d.stats() for name, d in self.dispatchers.items()}
        times = os.times()
        leases = self._leases
        return {"shard": self.name, "pid": os.getpid(), "dispatchers": out,
                "cpu_s": times.user + times.system,
                "lease_waits": leases.waits if leases else 0,
                "lease_outages": leases.outages if leases else 0}

    async def status(self) -> dict[str, Any]:
        """Its own dispatcher's status (the pools now)."""
        d = await self._dispatcher(self.name)
        return {**d.status(), "backend": "shards", "shard": self.name}

    async def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands in any dispatcher it runs (None: in none)."""
        for d in self.dispatchers.values():
            got = d.find(rid)
            if got is not None:
                return got
        return None

    async def close_trajectory(self, owner: str, name: str) -> None:
        """End trajectory ``name`` of shard ``owner``'s journal (this one's or one it
        adopted)."""
        d = self.dispatchers.get(owner)
        if d is not None:
            d.close_trajectory(name)

    async def close(self, drain: bool = True) -> dict[str, Any]:
        """Stop every dispatcher it runs (with ``drain``, once each has finished what
        it accepted); give back its leases. Returns its final stats."""
        for d in self.dispatchers.values():
            await d.close(drain=drain)
            await d.backend.close()
        if self._leases is not None:
            await self._leases.close()
        return await self.stats()


def _deliver(future: asyncio.Future, box: ResultBox) -> None:
    if not future.cancelled():
        box.put(future.result())
