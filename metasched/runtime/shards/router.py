"""Starting the shards and the lease service, and :class:`ShardRouter`, what submits to
them: each request goes to the shard that owns its trajectory (:mod:`.ring`; a request
without one, by its id), through one
:class:`~metasched.runtime.ray_backend.client.DispatcherHandle` per shard (the
requests of one loop turn in one call, results on one stream).

When a shard dies (its actor is gone: shards are not restarted in place, since another
takes over its journal), the router picks its adopter (the same one every router
picks), has it open the dead shard's journal, and sends it every request the dead
shard had not answered, under the same ids: each is answered from the journal if it
finished, joins its recovered copy if it was queued, or runs again if it was running
(at least once, as after any dispatcher's restart). New trajectories go to the live
shards from then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from metasched.errors import ConfigError
from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.leases.book import PoolLimit
from metasched.runtime.leases.service import LEASE_SERVICE, NAMESPACE, start_lease_service
from metasched.runtime.ray_backend.actor import YIELD_INTERVAL_S
from metasched.runtime.ray_backend.client import DispatcherHandle
from metasched.runtime.ray_backend.commands import lost
from metasched.runtime.requests import REJECTED, Request, Result
from metasched.runtime.shards.actor import ShardActor
from metasched.runtime.shards.ring import ShardRing

__all__ = ["ShardRouter", "shard_names", "start_shards", "stop_shards"]

log = logging.getLogger("metasched.shards")

MAX_CONCURRENCY = 10_000
# How long a dead shard's journal may stay locked (its process still exiting) before
# its unanswered requests are rejected.
ADOPT_WAIT_S = 30.0


def shard_names(n: int, prefix: str = "metasched-shard") -> list[str]:
    """The names of ``n`` shards."""
    return [f"{prefix}-{i}" for i in range(n)]


def start_shards(n: int, config: DispatcherConfig | None = None, *,
                 journal_dir: str | None = None, standin: Mapping[str, Any] | None = None,
                 pools: Mapping[str, PoolLimit] | None = None, lease_ttl_s: float = 5.0,
                 lease_file: str | None = None, prefix: str = "metasched-shard",
                 yield_s: float = YIELD_INTERVAL_S, lease_block: int = 1,
                 timeout_s: float = 300.0) -> ShardRouter:
    """Start the lease service (when ``pools`` name shared pools) and ``n`` shards on
    this node (where the journals are), each a named, detached actor; a router to them.

    Args:
        n: how many shards.
        config: every shard's dispatcher settings.
        journal_dir: the shards' journals' directory (None: none; a dead shard's
            requests are then lost to it and sent again to its adopter as new).
        standin: stand-in nodes per shard (``{"nodes": 1, "cores": 64}``) instead of
            the cluster's: commands end at once (for measuring the control plane).
        pools: the shared pools the lease service grants: an endpoint's quota named as
            the endpoint (the shards' ``config.endpoints`` must have it too), a GPU
            service's slots (:meth:`PoolLimit.service`) named as the service; a request
            on one runs only under a lease of it.
        lease_ttl_s: a lease's life unless renewed.
        lease_file: the lease service's file (what a restarted one reads back).
        prefix: the shards' names' prefix (``<prefix>-<i>``).
        yield_s: how often a shard's results stream may yield (see
            :class:`~metasched.runtime.shards.actor.ShardActor`).
        lease_block: leases a shard asks the lease service for in one call (the spare
            ones serve its next calls; see
            :class:`~metasched.runtime.leases.service.LeaseClient`).

    Raises:
        ConfigError: a shard cannot start (one line, naming the setting).
    """
    config = config or DispatcherConfig()
    pools = dict(pools or {})
    missing = sorted(p for p, limit in pools.items() if p not in config.endpoints
                     and (limit.calls, limit.tokens, limit.max_held is None) != (None, None, False))
    if missing:
        raise ConfigError("pools", f"{missing}: a shared pool is one of the dispatcher's "
                          f"endpoints ({sorted(config.endpoints)}) or a GPU service's slots "
                          f"(PoolLimit.service)")
    if pools:
        start_lease_service(pools, ttl_s=lease_ttl_s, path=lease_file)
    names = shard_names(n, prefix)
    actor = ray.remote(ShardActor)
    here = ray.get_runtime_context().get_node_id()
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(here, soft=False)
    actors = [actor.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=0, max_concurrency=MAX_CONCURRENCY,
        scheduling_strategy=strategy,
    ).remote(name, config, journal_dir, standin, tuple(pools), lease_ttl_s,
             yield_s=yield_s, shards=tuple(names), lease_block=lease_block)
        for name in names]
    infos = ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
    for info in infos:
        if "error" in info:
            for b in actors:
                ray.kill(b, no_restart=True)
            field, _, message = info["error"].partition(": ")
            raise ConfigError(field, message)
    return ShardRouter(names)


def stop_shards(names: list[str], *, drain: bool = True, leases: bool = True
                ) -> dict[str, Any]:
    """Close and remove the shards ``names`` (and, with ``leases``, the lease service);
    their final stats by name."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            a = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            out[name] = ray.get(a.close.remote(drain), timeout=120)
        except ray.exceptions.RayError as e:
            out[name] = {"error": lost(e)}
        ray.kill(a, no_restart=True)
    if leases:
        try:
            ray.kill(ray.get_actor(LEASE_SERVICE, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
    return out


class _ShardHandle(DispatcherHandle):
    """A handle to one shard's dispatcher; when the shard dies, the router's adopter
    takes its place (see the module docstring)."""

    def __init__(self, actor: Any, owner: str, router: ShardRouter) -> None:
        super().__init__(actor, owner)
        self.owner = owner
        self.router = router
        self.served_again_s: float | None = None  # death noticed -> adopter answering

    async def _resubmit(self) -> None:
        t0 = time.monotonic()
        try:
            info = await self.actor.ready.remote()
            if "error" not in info:  # alive after all (a passing error): send again
                return self._send_pending()
        except ray.exceptions.RayActorError:
            pass
        self.actor = ray.get_actor(self.router.ring.leave(self.owner), namespace=NAMESPACE)
        await self._adopt()
        self.served_again_s = time.monotonic() - t0

    def adopt_first(self) -> None:
        """This handle's shard was gone before its first use: have the actor it holds
        (the adopter) adopt it before anything is sent (sends wait meanwhile)."""
        self._recovering = asyncio.get_running_loop().create_task(self._adopt())

    async def _adopt(self) -> None:
        """Have ``self.actor`` adopt this handle's dead shard, then send what is
        unanswered. A dead shard's process may hold its journal a moment longer (an
        actor killed by Ray exits gracefully): the adopter tries again until
        ``ADOPT_WAIT_S`` has passed, then every unanswered request is rejected."""
        deadline = time.monotonic() + ADOPT_WAIT_S
        while True:
            try:
                info = await self.actor.adopt.remote(self.owner, self.client)
                break
            except ray.exceptions.RayTaskError as e:
                if time.monotonic() > deadline:
                    gone = f"shard {self.owner} is gone and its journal could not be " \
                           f"adopted within {ADOPT_WAIT_S:g} s: {lost(e)}"
                    for rid in list(self._sent):
                        self._answer(Result(rid, REJECTED, gone))
                    self._recovering = None
                    return
                await asyncio.sleep(0.2)
        log.warning("shard %s is gone: %s took over its journal (%d requests recovered)",
                    self.owner, info["shard"], info["recovered"])
        self._send_pending()

    def _send_pending(self) -> None:
        pending = [s for entries in self._sent.values() for s in entries]
        self._recovering = None
        self._batch = pending
        self._send()


class ShardRouter:
    """Submits to the shards ``names`` (see the module docstring); one event loop."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.ring = ShardRing(names)
        self._handles: dict[str, _ShardHandle] = {}

    def _handle(self, owner: str) -> _ShardHandle:
        h = self._handles.get(owner)
        if h is None:
            try:
                actor = ray.get_actor(self.ring.serving(owner), namespace=NAMESPACE)
            except ValueError:  # gone before this router first used it
                actor = None
            if actor is not None:
                h = self._handles[owner] = _ShardHandle(actor, owner, self)
            else:
                adopter = ray.get_actor(self.ring.leave(owner), namespace=NAMESPACE)
                h = self._handles[owner] = _ShardHandle(adopter, owner, self)
                h.adopt_first()
        return h

    def key(self, request: Request | Mapping[str, Any]) -> str:
        """What places ``request``: its trajectory, else its id."""
        get = request.get if isinstance(request, Mapping) else \
            lambda k: getattr(request, k, None)
        trajectory = get("trajectory")
        return str(trajectory) if trajectory is not None else str(get("id") or "")

    def owner(self, request: Request | Mapping[str, Any]) -> str:
        """The shard whose journal ``request`` goes to."""
        return self.ring.owner(self.key(request))

    def handle_of(self, request: Request | Mapping[str, Any]) -> DispatcherHandle:
        """The handle ``request`` is submitted through (its shard's)."""
        return self._handle(self.owner(request))

    def accept(self, request: Request | Mapping[str, Any], *, call: Any = None
               ) -> asyncio.Future[Result]:
        """Accept ``request`` on its shard; the future of its result."""
        return self.handle_of(request).accept(request, call=call)

    async def submit(self, request: Request | Mapping[str, Any], *, call: Any = None
                     ) -> Result:
        """Run ``request`` on its shard; its result."""
        return await self.accept(request, call=call)

    def close_trajectory(self, trajectory: str) -> None:
        """``trajectory`` is done: end it on its shard and forget its place."""
        owner = self.ring.placed.get(str(trajectory))
        if owner is not None:
            actor = ray.get_actor(self.ring.serving(owner), namespace=NAMESPACE)
            actor.close_trajectory.remote(owner, str(trajectory))
            self.ring.forget(str(trajectory))

    def served_again_s(self) -> dict[str, float]:
        """Per dead shard, how long from its death being noticed to its adopter
        having its requests."""
        return {o: h.served_again_s for o, h in self._handles.items()
                if h.served_again_s is not None}

    async def astats(self) -> dict[str, Any]:
        """Every live shard's stats, by name."""
        live = self.ring.live
        got = await asyncio.gather(*(ray.get_actor(n, namespace=NAMESPACE).stats.remote()
                                     for n in live))
        return dict(zip(live, got, strict=True))

    async def aclose(self) -> None:
        """Stop reading results (unanswered futures are cancelled)."""
        for h in self._handles.values():
            await h.aclose()
