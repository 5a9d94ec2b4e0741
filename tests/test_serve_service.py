"""The service itself: its memory of finished results (``Submissions``: the last
``keep``, whose output together stays under ``keep_bytes``, so that a download's pieces
do not pile up), and its start (it answers while it probes and takes up the journal)."""

from __future__ import annotations

import asyncio

from metasched.runtime.requests import DONE, Result
from metasched.serve.frontend import Submissions


async def test_kept_results_hold_at_most_keep_bytes_of_output():
    subs = Submissions(lambda: None, keep=100, keep_bytes=10_000)
    loop = asyncio.get_running_loop()
    for i in range(30):
        f = loop.create_future()
        subs.track(f"r{i}", f)
        f.set_result(Result(f"r{i}", DONE, stdout="x" * 1_000))
    await asyncio.sleep(0)  # the done callbacks
    assert list(subs.done) == [f"r{i}" for i in range(20, 30)]  # the newest 10 KB
    assert subs._bytes == 10_000
    f = loop.create_future()
    subs.track("r20", f)  # the same id again: counted once
    f.set_result(Result("r20", DONE, stderr="y" * 500))
    await asyncio.sleep(0)
    assert len(subs.done) == 10 and subs._bytes == 9_500


def test_the_service_answers_while_it_probes_and_recovers():
    """``metasched-serve``'s start: listening once the dispatcher runs, ``/v1/health``
    ``starting`` until the languages are probed (and the journal taken up), ``ok``
    after."""
    import threading
    import time

    import httpx
    import uvicorn
    from helpers import free_port

    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.serve import ServeConfig, create_app
    from metasched.serve.server import _run, uvicorn_config

    app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy")),
                     ServeConfig(languages=[]))
    service = app.state.service
    release = threading.Event()

    async def slow_probe(svc, names):
        while not release.is_set():
            await asyncio.sleep(0.05)
        return {}, {}

    service._probe = slow_probe
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=lambda: asyncio.run(_run(app, server, probe_later=True)))
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/v1/ping", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert httpx.get(f"{url}/v1/health", timeout=5).status_code == 503  # still probing
        release.set()
        for _ in range(200):
            if httpx.get(f"{url}/v1/health", timeout=5).status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(f"{url}/v1/health", timeout=5).json()["status"] == "ok"
    finally:
        release.set()
        server.should_exit = True
        thread.join(60)
