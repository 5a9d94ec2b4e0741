"""The service's memory of finished results (``Submissions``): the last ``keep``, whose
output together stays under ``keep_bytes`` (a download's pieces must not pile up)."""

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
