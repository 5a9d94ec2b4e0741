"""Running the application on uvicorn: :func:`serve` (the foreground, as
``metasched-serve`` does) and :class:`BackgroundServer` (a thread of its own, with its
own event loop: tests, examples, and a rollout driver that hosts the service itself).

Both start the service (its dispatcher, the language probes) before uvicorn listens, so
a setting that cannot work here is raised as the :class:`~metasched.errors.ConfigError`
it is, before any client connects, and close it after uvicorn has stopped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import threading
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from metasched.serve.config import ServeConfig
from metasched.serve.connections import GuardedH11Protocol, default_max_connections

__all__ = ["BackgroundServer", "serve", "uvicorn_config"]

log = logging.getLogger("metasched.serve")


def uvicorn_config(app: Any, host: str, port: int, *, graceful_s: float | None = 30.0,
                   log_level: str = "info", access_log: bool = False) -> uvicorn.Config:
    """The uvicorn settings the service runs with: the plain asyncio loop (the
    dispatcher's executors are tested on it), the h11 protocol with a deadline for a
    request's headers and a cap on open connections (the service's ``header_timeout_s``
    and ``max_connections``, see :mod:`~metasched.serve.connections`; requests are not
    limited: the service queues rather than refusing), a listen backlog for bursts of
    thousands of clients, and ``graceful_s`` for requests in flight at shutdown. The
    service is started and closed around uvicorn (its lifespan is not left to
    uvicorn)."""
    service = getattr(getattr(app, "state", None), "service", None)
    config = service.config if service is not None else ServeConfig(languages=[])
    http = functools.partial(
        GuardedH11Protocol, header_timeout_s=config.header_timeout_s,
        max_connections=config.max_connections or default_max_connections())
    return uvicorn.Config(app, host=host, port=port, loop="asyncio", lifespan="off",
                          http=http, log_level=log_level, access_log=access_log,
                          backlog=4096, timeout_graceful_shutdown=graceful_s,
                          timeout_keep_alive=30)


async def _run(app: FastAPI, server: uvicorn.Server, *, probe_later: bool = False) -> None:
    """Start the service and serve until stopped. With ``probe_later`` it listens once
    the dispatcher runs (``/v1/ping`` answers, ``/v1/health`` says ``starting``) while
    the languages are probed and the journal's unfinished requests taken up; a probe
    that fails stops it with the error."""
    service = app.state.service
    sockets = None
    try:
        sockets = _door_sockets(app, server)
        await service.start(probe_later=probe_later)
        if not probe_later:
            await server.serve(sockets=sockets)
            return
        serving = asyncio.ensure_future(server.serve(sockets=sockets))
        try:
            await service.probed()
        except BaseException:
            server.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)
            raise
        await serving
    finally:
        # Also after a start that failed or was interrupted part way (a stop signal
        # during start-up): what it had started closes.
        if service.dispatcher is not None:
            await service.close()
        for sock in sockets or ():
            sock.close()


def _door_sockets(app: FastAPI, server: uvicorn.Server) -> list[socket.socket] | None:
    """With ``e2b_sdk1_ports``, the sockets to serve: the service's, then SDK 1.x's
    (:func:`~metasched.serve.e2b.sdk1_door.bind_door`); None: uvicorn binds its own.

    Raises:
        ConfigError: one of SDK 1.x's ports is taken, or the E2B API is off.
    """
    from metasched.errors import ConfigError
    from metasched.serve.e2b.sdk1_door import SDK1_PORTS, bind_door

    if not app.state.service.config.e2b_sdk1_ports:
        return None
    if getattr(app.state, "e2b", None) is None:
        raise ConfigError("e2b_sdk1_ports", "the E2B API is off here (pip install "
                          "'metasched[e2b]')")
    door = bind_door()
    log.info("E2B SDK 1.x door: 127.0.0.1:%s (E2B_DEBUG=true)",
             ", ".join(map(str, SDK1_PORTS)))
    return [server.config.bind_socket(), *door]


def serve(app: FastAPI, host: str, port: int, **kwargs: Any) -> int | None:
    """Serve ``app`` (made by :func:`~metasched.serve.app.create_app`) until SIGINT,
    SIGTERM or SIGHUP; requests in flight then get ``graceful_s`` to finish. Returns
    the signal that stopped it (None if none did).

    Raises:
        ConfigError: the service cannot start with its settings (nothing listened).
    """
    server = uvicorn.Server(uvicorn_config(app, host, port, **kwargs))
    hung_up: list[int] = []

    def hang_up(signum: int, frame: object) -> None:
        hung_up.append(signum)
        server.handle_exit(signum, frame)

    previous = signal.signal(signal.SIGHUP, hang_up)  # uvicorn takes SIGINT and SIGTERM
    try:
        asyncio.run(_run(app, server, probe_later=True))
    finally:
        signal.signal(signal.SIGHUP, previous)
    return hung_up[0] if hung_up else None


class BackgroundServer:
    """``app`` served on ``host`` in a thread, on a port of its own (``port=0``: a free
    one); ``url`` once started. Use ``with BackgroundServer(app) as srv:``.

    Raises (from ``start``):
        ConfigError: the service's settings do not work here.
        RuntimeError: it did not start for another reason (chained).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 start_timeout_s: float = 120.0, **kwargs: Any) -> None:
        kwargs.setdefault("log_level", "warning")
        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, host, port, **kwargs))
        self.server.install_signal_handlers = lambda: None  # not the main thread's
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="metasched-serve",
                                        daemon=True)
        self.url = ""

    def _main(self) -> None:
        try:
            asyncio.run(_run(self.app, self.server))
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self) -> BackgroundServer:
        from metasched.errors import ConfigError

        self._thread.start()
        waited = 0.0
        while not self.server.started and self._thread.is_alive() \
                and waited < self.start_timeout_s:
            self._thread.join(0.01)
            waited += 0.01
        if not self.server.started:
            self.stop()
            if isinstance(self._error, ConfigError):
                raise self._error
            raise RuntimeError("the service did not start") from self._error
        port = self.server.servers[0].sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Shut down (requests in flight get the graceful time) and wait for it."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
