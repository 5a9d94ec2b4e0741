"""Running the application on uvicorn: :func:`serve` (the foreground, as
``metasched-serve`` does) and :class:`BackgroundServer` (a thread of its own, with its
own event loop: tests, examples, and a rollout driver that hosts the service itself)."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import uvicorn

__all__ = ["BackgroundServer", "serve", "uvicorn_config"]


def uvicorn_config(app: Any, host: str, port: int, *, graceful_s: float | None = 30.0,
                   log_level: str = "info", access_log: bool = False) -> uvicorn.Config:
    """The uvicorn settings the service runs with: the plain asyncio loop (the
    dispatcher's executors are tested on it), no connection limit (the service queues
    rather than refusing), a listen backlog for bursts of thousands of clients, and
    ``graceful_s`` for requests in flight at shutdown."""
    return uvicorn.Config(app, host=host, port=port, loop="asyncio", lifespan="on",
                          log_level=log_level, access_log=access_log, backlog=4096,
                          timeout_graceful_shutdown=graceful_s, timeout_keep_alive=30)


def serve(app: Any, host: str, port: int, **kwargs: Any) -> None:
    """Serve ``app`` until SIGINT or SIGTERM (then requests in flight get
    ``graceful_s`` to finish)."""
    uvicorn.Server(uvicorn_config(app, host, port, **kwargs)).run()


class BackgroundServer:
    """``app`` served on ``host`` in a thread, on a port of its own (``port=0``: a free
    one); ``url`` once started. Use ``with BackgroundServer(app) as srv:``.

    Raises:
        RuntimeError: the server did not start (its lifespan failed, e.g. the
            dispatcher's settings do not work here: the cause is chained).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 start_timeout_s: float = 60.0, **kwargs: Any) -> None:
        kwargs.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn_config(app, host, port, **kwargs))
        self.server.install_signal_handlers = lambda: None  # not the main thread's
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="metasched-serve",
                                        daemon=True)
        self.url = ""

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self) -> BackgroundServer:
        self._thread.start()
        self._thread.join(0.0)
        deadline = self.start_timeout_s
        step = 0.01
        while not self.server.started and self._thread.is_alive() and deadline > 0:
            self._thread.join(step)
            deadline -= step
        if not self.server.started:
            self.stop()
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
