"""The service on a free 127.0.0.1 port for a test, over a dispatcher made for it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.serve import BackgroundServer, ServeConfig, create_app


@dataclass
class Served:
    """A running service: its base URL and the dispatcher behind it (read the
    dispatcher's state only; it runs on the server's thread)."""

    url: str
    dispatcher: Dispatcher


@contextmanager
def serving(dispatcher_config: DispatcherConfig | None = None,
            config: ServeConfig | None = None, **kwargs) -> Iterator[Served]:
    """Serve a dispatcher (elastic_greedy, no journal unless given) until the block
    ends (the dispatcher is made on the server's thread, which its journal needs)."""
    dcfg = dispatcher_config or DispatcherConfig(scheduler="elastic_greedy")
    # No /run_code languages unless asked for: probing them takes seconds.
    app = create_app(lambda: Dispatcher(dcfg, **kwargs), config or ServeConfig(languages=[]))
    with BackgroundServer(app) as srv:
        yield Served(srv.url, app.state.service.dispatcher)


def wait_for_ping(url: str, p: subprocess.Popen, timeout_s: float = 90) -> None:
    """Wait until the service process ``p`` answers ``/v1/ping`` at ``url``; fail with
    its stderr if it exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v1/ping", timeout=5).json() == "pong":
                return
        except httpx.TransportError:
            pass
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
        time.sleep(0.2)
