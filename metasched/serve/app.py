"""The HTTP service in front of one dispatcher: :func:`create_app` builds the ASGI
application (FastAPI) over a :class:`Service`, which holds the dispatcher, what was
submitted through it, the metrics, the quota proxy's HTTP client and the ``/run_code``
languages.

The service and the dispatcher share one event loop: a request is accepted by the
dispatcher in the handler that received it, without a hop through a queue or a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from metasched.errors import ConfigError, validation_error
from metasched.runtime.limits import RequestLimits
from metasched.runtime.requests import Result
from metasched.serve.config import ServeConfig
from metasched.serve.frontend import DispatcherLike, Submissions
from metasched.serve.languages import Language
from metasched.serve.metrics import ServiceMetrics
from metasched.serve.native import error, native_router
from metasched.serve.ownership import Owners
from metasched.serve.quota_proxy import proxy_router
from metasched.serve.sandbox_fusion import probe_languages, run_code_router
from metasched.serve.security import Gate

__all__ = ["Service", "create_app"]

log = logging.getLogger("metasched.serve")


class Service:
    """Everything the routes share (see the module docstring).

    Args:
        dispatcher: the dispatcher to front (not started yet if ``owns``), or a
            function that makes it, called at start on the service's thread (a
            dispatcher's journal must be opened on the thread that uses it).
        config: the service's settings.
        owns: start the dispatcher with the service and close it after (else the
            caller does both).
    """

    def __init__(self, dispatcher: DispatcherLike | Callable[[], DispatcherLike],
                 config: ServeConfig, *, owns: bool = True) -> None:
        self._make = dispatcher if not isinstance(dispatcher, DispatcherLike) else None
        self.dispatcher: DispatcherLike = None if self._make else dispatcher  # type: ignore
        self.config = config
        self.owns = owns
        self.submissions = Submissions(lambda: self.dispatcher, config.keep_results)
        self.metrics = ServiceMetrics(lambda: self.dispatcher.status())
        self.http: httpx.AsyncClient | None = None
        self.languages: dict[str, Language] = {}  # /run_code's, once probed
        self.unavailable: dict[str, str] = {}  # the others: why not
        self.owners = Owners(set(config.clients.values()))
        self.limits = RequestLimits()  # the dispatcher's, once started
        self.ready = False

    async def start(self) -> None:
        """Make (if given a function) and start (if the service owns it) the
        dispatcher, and the proxy's client."""
        from metasched.runtime.api_calls import make_client, warm_up

        if self.ready:
            return
        if self._make is not None:
            self.dispatcher = self._make()
        if self.owns:
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
        self.languages, self.unavailable = await probe_languages(self, self.config.languages)
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
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self.owns:
            await self.dispatcher.close(drain=False)
        if self._make is not None:
            # Made here, so let it go: FastAPI caches the route functions, which hold this
            # service, for the life of the process; a closed dispatcher (and its event
            # loop) need not stay with them.
            self.dispatcher = None  # type: ignore[assignment]

    async def submit(self, request: dict[str, Any]) -> Result:
        """Submit one request (the dispatcher's JSON), tracked as the native API's are,
        and wait for its result."""
        rid = request.setdefault("id", uuid.uuid4().hex)
        future = self.dispatcher.accept(request)
        self.track(rid, future, request.get("kind"))
        # shield: a client that leaves does not cancel its action (it runs to the end).
        return await asyncio.shield(future)

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


class _CountRequests:
    """ASGI middleware: HTTP requests by route and status, and their duration."""

    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", "unmatched")
            self.metrics.http.labels(name, str(status[0])).inc()
            self.metrics.http_seconds.labels(name).observe(time.perf_counter() - t0)


def create_app(dispatcher: DispatcherLike | Callable[[], DispatcherLike],
               config: ServeConfig | None = None, *, owns: bool = True) -> FastAPI:
    """The ASGI application serving ``dispatcher`` (run it with uvicorn, or
    ``metasched-serve``).

    Args:
        dispatcher: a :class:`~metasched.runtime.dispatch.Dispatcher` (or any object
            with its methods, see :class:`~metasched.serve.frontend.DispatcherLike`), or
            a function returning one, called when the application starts (on the thread
            that serves it: needed for a dispatcher with a journal served from another
            thread than the one making the application).
        config: the service's settings (default: ``ServeConfig()``).
        owns: the application starts the dispatcher and closes it (its lifespan).
    """
    config = config or ServeConfig()
    service = Service(dispatcher, config, owns=owns)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="metasched", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.service = service

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A body a route's model rejects (/run_code's): one line naming the field, as
        # the dispatcher's own rejections. FastAPI reads a body as JSON only when it says
        # it is (curl -d sends a form's type): say that, not that the JSON is no object.
        kind = request.headers.get("content-type", "")
        if "json" not in kind and any(e.get("loc") == ("body",) for e in exc.errors()):
            return error(422, f"body: send it as JSON (Content-Type: application/json; "
                              f"got {kind or 'none'})")
        return error(422, str(validation_error(exc.errors(), strip=("body",), root="body")))

    @app.exception_handler(ConfigError)
    async def bad_input(request: Request, exc: ConfigError) -> JSONResponse:
        return error(422, str(exc))

    app.include_router(native_router(service))
    app.include_router(proxy_router(service))
    app.include_router(run_code_router(service))
    # The last added is the outermost: requests refused by the gate are counted too.
    app.add_middleware(Gate, clients=config.clients, max_body=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s)
    app.add_middleware(_CountRequests, metrics=service.metrics)
    return app
