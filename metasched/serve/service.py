"""What the HTTP service's routes share: :class:`Service` holds the dispatcher, what was
submitted through it, the metrics, the quota proxy's HTTP client and the ``/run_code``
languages (the application around it is :mod:`metasched.serve.app`'s).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from metasched.runtime.limits import RequestLimits
from metasched.runtime.requests import Result
from metasched.serve.config import ServeConfig
from metasched.serve.frontend import DispatcherLike, RecoversLater, Submissions
from metasched.serve.languages import Language
from metasched.serve.metrics import ServiceMetrics
from metasched.serve.ownership import Owners

__all__ = ["LanguageProbe", "Service"]

log = logging.getLogger("metasched.serve")

# (service, the languages asked for, None: all) -> the working ones, and why not the others
LanguageProbe = Callable[["Service", "list[str] | None"],
                         Awaitable[tuple[dict[str, Language], dict[str, str]]]]


class Service:
    """Everything the routes share (see the module docstring).

    Args:
        dispatcher: the dispatcher to front (not started yet if ``owns``), or a
            function that makes it, called at start on the service's thread (a
            dispatcher's journal must be opened on the thread that uses it).
        config: the service's settings.
        probe: finds which ``/run_code`` languages work here, at start
            (:func:`metasched.serve.sandbox_fusion.probe_languages`, which
            :func:`~metasched.serve.app.create_app` passes).
        owns: start the dispatcher with the service and close it after (else the
            caller does both).
    """

    def __init__(self, dispatcher: DispatcherLike | Callable[[], DispatcherLike],
                 config: ServeConfig, *, probe: LanguageProbe, owns: bool = True) -> None:
        self._make = dispatcher if not isinstance(dispatcher, DispatcherLike) else None
        self.dispatcher: DispatcherLike = None if self._make else dispatcher  # type: ignore
        self.config = config
        self.owns = owns
        self._probe = probe
        self.submissions = Submissions(lambda: self.dispatcher, config.keep_results)
        self.metrics = ServiceMetrics(lambda: self.dispatcher.status())
        self.http: httpx.AsyncClient | None = None
        self.generation: Any = None  # the OpenAI front door's GenerationDoor, if configured
        self.languages: dict[str, Language] = {}  # /run_code's, once probed
        self.unavailable: dict[str, str] = {}  # the others: why not
        self.owners = Owners(set(config.clients.values()))
        self.limits = RequestLimits()  # the dispatcher's, once started
        self.ready = False
        self._probing: asyncio.Future[None] | None = None  # with start(probe_later=True)

    async def start(self, *, probe_later: bool = False) -> None:
        """Make (if given a function) and start (if the service owns it) the
        dispatcher, and the proxy's client; then probe the languages and take up the
        journal's unfinished requests, or, with ``probe_later``, start doing so in
        the background (:meth:`probed` waits for it: the service answers meanwhile)."""
        from metasched.runtime.api_calls import make_client, warm_up

        if self.ready:
            return
        if self._make is not None:
            self.dispatcher = self._make()
        # Recovered work is taken up once the service is ready: its probe does not wait
        # behind it, and clients are answered while it runs.
        later = self.owns and isinstance(self.dispatcher, RecoversLater)
        if later:
            await self.dispatcher.start(recover=False)
        elif self.owns:
            await self.dispatcher.start()
        limits = self.dispatcher.status().get("limits")
        if limits is not None:
            self.limits = RequestLimits.from_dict(limits)
        if self.config.upstreams:
            concurrency = self.dispatcher.status()["pools"]["api"]
            self.http = make_client(max_keepalive=max(1, sum(
                concurrency[n]["max_concurrency"] for n in self.config.upstreams
                if n in concurrency)))
            await warm_up()
        if self.config.generation is not None:
            from metasched.serve.generation_door import GenerationDoor

            self.generation = GenerationDoor(self.config.generation, lambda: self.dispatcher)
        if probe_later:
            self._probing = asyncio.ensure_future(self._probe_then_recover(later))
        else:
            await self._probe_then_recover(later)

    async def probed(self) -> None:
        """Wait until the languages are probed (ConfigError if one asked for by name
        does not work)."""
        if self._probing is not None:
            await asyncio.shield(self._probing)

    async def _probe_then_recover(self, recover: bool) -> None:
        self.languages, self.unavailable = await self._probe(self, self.config.languages)
        if recover:
            self.dispatcher.recover()
        self.ready = True
        stats = self.dispatcher.stats()
        log.info("metasched-serve: scheduler %s%s; /run_code languages: %s; proxied "
                 "endpoints: %s", stats["scheduler"],
                 f" (fell back: {stats['fallback']})" if stats["fallback"] else "",
                 ", ".join(sorted(self.languages)) or "none",
                 ", ".join(sorted(self.config.upstreams)) or "none")
        log.info("request limits: %s", self.limits.describe())
        for name, why in sorted(self.unavailable.items()):
            log.debug("/run_code %s: %s", name, why)

    async def close(self) -> None:
        """Stop: the proxy's client closes; an owned dispatcher closes without draining
        (running commands are killed; what did not finish stays in its journal)."""
        self.ready = False
        if self._probing is not None and not self._probing.done():
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self.generation is not None:
            await self.generation.close()
            self.generation = None
        if self.owns:
            await self.dispatcher.close(drain=False)
        if self._make is not None:
            # Made here, so let it go: FastAPI caches the route functions, which hold this
            # service, for the life of the process; a closed dispatcher (and its event
            # loop) need not stay with them.
            self.dispatcher = None  # type: ignore[assignment]

    async def submit(self, request: dict[str, Any]) -> Result:
        """Submit one request (the dispatcher's JSON), tracked as the native API's are,
        and wait for its result (``on_restart: cancel`` unless it says otherwise: a
        dispatcher restarted after a crash does not run it again for a caller gone
        with its connection)."""
        rid = request.setdefault("id", uuid.uuid4().hex)
        # Its caller waits on this connection: after a crash nobody is there to answer.
        request.setdefault("on_restart", "cancel")
        future = self.dispatcher.accept(request)
        self.track(rid, future, request.get("kind"))
        # shield: a client that leaves does not cancel its action (it runs to the end).
        return await asyncio.shield(future)

    def cancel(self, rid: str, cause: str) -> str:
        """Cancel action ``rid`` (see :meth:`Dispatcher.cancel
        <metasched.runtime.dispatch.Dispatcher.cancel>`; ``cause``: ``disconnect`` or
        ``request``, counted in ``/metrics``). A dispatcher that cannot cancel (one
        elsewhere) answers ``running``."""
        cancel = getattr(self.dispatcher, "cancel", None)
        if cancel is None:
            return "running"
        state = cancel(rid)
        if state in ("cancelled", "cancelling"):
            self.metrics.cancels.labels(cause).inc()
        return state

    def track(self, rid: str, future: asyncio.Future[Result], kind: Any) -> None:
        """Keep ``future`` for ``GET /v1/actions/{rid}`` and measure its ACT."""
        self.submissions.track(rid, future)
        act = self.metrics.act

        def observe(f: asyncio.Future[Result]) -> None:
            if not f.cancelled() and f.result().status != "rejected":
                x = f.result().act_s
                if x == x:
                    act.labels(str(kind)).observe(x)

        future.add_done_callback(observe)

    def status(self) -> dict[str, Any]:
        """The dispatcher's status, with the service's own part (``service``)."""
        return {**self.dispatcher.status(),
                "service": {"ready": self.ready, "proxied": sorted(self.config.upstreams),
                            "languages": sorted(self.languages),
                            "unavailable": dict(sorted(self.unavailable.items())),
                            "in_flight": len(self.submissions.pending)}}
