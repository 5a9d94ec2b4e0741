"""The HTTP service in front of one dispatcher: :func:`create_app` builds the ASGI
application (FastAPI) over a :class:`~metasched.serve.service.Service`, which holds the
dispatcher, what was submitted through it, the metrics, the quota proxy's HTTP client and
the ``/run_code`` languages.

The service and the dispatcher share one event loop: a request is accepted by the
dispatcher in the handler that received it, without a hop through a queue or a thread.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from metasched.errors import ConfigError, validation_error
from metasched.serve.config import ServeConfig
from metasched.serve.e2b import PREFIX as E2B_PREFIX
from metasched.serve.e2b import mount_e2b
from metasched.serve.frontend import DispatcherLike
from metasched.serve.jupyter import jupyter_router
from metasched.serve.metrics import ServiceMetrics
from metasched.serve.native import error, native_router
from metasched.serve.openai_routes import openai_router
from metasched.serve.quota_proxy import proxy_router
from metasched.serve.sandbox_fusion import probe_languages, run_code_router
from metasched.serve.security import Gate
from metasched.serve.service import Service

__all__ = ["Service", "create_app"]


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
    service = Service(dispatcher, config, probe=probe_languages, owns=owns)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            e2b = getattr(app.state, "e2b", None)
            if e2b is not None:
                await e2b.close()
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
    app.include_router(jupyter_router(service))
    app.include_router(openai_router(service))  # /v1/chat/completions, /v1/completions
    mount_e2b(app, service)  # /e2b: checks its own API keys and access tokens
    # The last added is the outermost: requests refused by the gate are counted too.
    app.add_middleware(Gate, clients=config.clients, max_body=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s, own_auth=(E2B_PREFIX + "/",),
                       streamed={("POST", E2B_PREFIX + "/files"): config.max_file_bytes})
    app.add_middleware(_CountRequests, metrics=service.metrics)
    if config.e2b_sdk1_ports and getattr(app.state, "e2b", None) is not None:
        from metasched.serve.e2b.sdk1_door import SDK1Door

        # Outermost: what came on SDK 1.x's ports is gated and counted as /e2b's.
        app.add_middleware(SDK1Door, sandboxes=app.state.e2b)
    return app
