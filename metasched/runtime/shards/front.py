"""The shards behind one dispatcher's interface, for the HTTP service's front doors
(``metasched.serve.create_app(lambda: ShardedDispatcher(names))``): ``/run_code``,
``/run_jupyter``, ``/v1`` and the E2B routes submit as to one dispatcher, and each
request goes to the shard that owns its trajectory (an E2B sandbox id and a
``/run_code`` trajectory header are trajectories), through a :class:`ShardRouter`.

Status and counters are fetched from every live shard in the background (as
:class:`~metasched.runtime.ray_backend.remote.RemoteDispatcher` does for one actor):
the status is the first shard's (the shards share their settings: limits, pools) with
each shard's own under ``shards``; the counters are summed over the shards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import ray

from metasched.runtime.leases.service import NAMESPACE
from metasched.runtime.ray_backend.commands import lost
from metasched.runtime.ray_backend.remote import POLL_S
from metasched.runtime.requests import Request, Result
from metasched.runtime.shards.router import ShardRouter

__all__ = ["ShardedDispatcher"]

log = logging.getLogger("metasched.shards")


class ShardedDispatcher:
    """Running shards ``names`` as one dispatcher (see the module docstring). The shards
    are started (:func:`~metasched.runtime.shards.start_shards`) and stopped by their
    owner, not by this object."""

    remote = True  # its API calls run in a shard: a call must be picklable

    def __init__(self, names: list[str]) -> None:
        self.router = ShardRouter(names)
        self.name = ",".join(names)
        self._status: dict[str, Any] = {}
        self._stats: dict[str, Any] = {}
        self._poll: asyncio.Task | None = None

    def describe(self) -> str:
        return f"{len(self.router.names)} dispatcher shards on Ray ({self.name})"

    async def start(self) -> None:
        """Fetch the shards' status, then keep it fresh."""
        await self.refresh()
        self._poll = asyncio.ensure_future(self._poll_status())

    async def refresh(self) -> None:
        live = list(self.router.ring.live)
        actors = [ray.get_actor(n, namespace=NAMESPACE) for n in live]
        statuses = await asyncio.gather(*(a.status.remote() for a in actors))
        stats = await asyncio.gather(*(a.stats.remote() for a in actors))
        self._status = {**statuses[0], "shards": dict(zip(live, statuses, strict=True))}
        self._stats = _summed([d for s in stats for d in s["dispatchers"].values()])

    async def _poll_status(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.refresh()
            except ray.exceptions.RayError as e:  # a shard died: its adopter answers next
                log.debug("status of the shards: %s", lost(e))

    async def close(self, *, drain: bool = True) -> None:
        """Stop submitting (the shards go on: their owner stops them)."""
        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
            self._poll = None
        await self.router.aclose()

    def accept(self, request: Request | Mapping[str, Any], *, call: Any = None
               ) -> asyncio.Future[Result]:
        return self.router.accept(request, call=call)

    async def enqueue(self, request: Request | Mapping[str, Any], *, call: Any = None
                      ) -> asyncio.Future[Result]:
        handle = self.router.handle_of(request)
        return await handle.enqueue(request, call=call)

    async def submit(self, request: Request | Mapping[str, Any], *, call: Any = None
                     ) -> Result:
        return await self.router.submit(request, call=call)

    def stats(self) -> dict[str, Any]:
        """The shards' counters, summed, as last fetched."""
        return self._stats

    def status(self) -> dict[str, Any]:
        """The first shard's status with every shard's own (``shards``), as last
        fetched."""
        return self._status

    async def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands: asked of every live shard (an id says nothing
        of its trajectory)."""
        for name in self.router.ring.live:
            got = await ray.get_actor(name, namespace=NAMESPACE).find.remote(rid)
            if got is not None:
                return got
        return None

    def close_trajectory(self, name: str) -> None:
        self.router.close_trajectory(name)


def _summed(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over dispatchers (other values: the first one's)."""
    out = dict(stats[0]) if stats else {}
    for s in stats[1:]:
        for k, v in s.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and \
                    isinstance(out.get(k), int | float):
                out[k] = out[k] + v
    return out
