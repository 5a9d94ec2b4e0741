"""Durability: kill -9 of a dispatcher with over 1,000 accepted, unfinished requests;
a new dispatcher on the same journal completes every one of them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import psutil

from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig
from metasched.runtime.journal import Journal

N = 1200

# The child dispatcher accepts N requests, then serves them until it is killed. Each
# request waits for the gate file (so few finish before the kill) and exits at once
# when it exists (so the restarted dispatcher completes them quickly).
CHILD = textwrap.dedent("""
    import asyncio, sys
    from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig

    async def main(db, gate, n):
        cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db, sample_interval_s=0.1)
        async with Dispatcher(cfg) as d:
            for i in range(n):
                d.accept({"id": f"r{i}", "kind": "cpu", "timeout_s": 120,
                          "argv": ["/bin/sh", "-c", 'test -e "$0" || sleep 60', gate]})
            d.flush()  # durable now (otherwise at the end of this loop turn)
            print("accepted", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def test_kill_9_loses_nothing(tmp_path):
    db, gate = tmp_path / "journal.db", tmp_path / "gate"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db), str(gate), str(N)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "accepted"
        # Until the running actions have recorded their pids (read beside the live writer).
        with Journal(db, lock=False) as j:
            for _ in range(200):
                if len(j.orphans()) >= 1:
                    break
                asyncio.run(asyncio.sleep(0.05))
            orphans = j.orphans()
            counts = j.counts()
        assert counts["finished"] == 0 and counts["queued"] + counts["running"] == N
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    assert orphans, "the killed dispatcher left its running commands"
    leftover = [pid for _, pid in orphans if psutil.pid_exists(pid)]
    assert leftover  # still sleeping: their dispatcher is gone
    scratch = [psutil.Process(pid).cwd() for pid in leftover]
    assert all(os.path.isdir(d) for d in scratch)

    gate.write_text("")

    async def restart():
        async with Dispatcher(DispatcherConfig(scheduler="elastic_greedy", journal=db,
                                               sample_interval_s=0.1)) as d:
            futs = [d.accept({"id": f"r{i}", "kind": "cpu", "timeout_s": 120,  # resubmitted
                              "argv": ["/bin/sh", "-c", 'test -e "$0" || sleep 60',
                                       str(gate)]}) for i in range(N)]
            return await asyncio.gather(*futs), d.state.n_submitted
    results, submitted = asyncio.run(restart())
    assert submitted == N  # re-queued from the journal; the resubmissions were deduplicated
    assert [r.status for r in results] == ["done"] * N, {r.reason for r in results}
    assert {r.id for r in results} == {f"r{i}" for i in range(N)}
    assert all(r.attempts >= 1 for r in results)
    with Journal(db) as j:
        assert j.counts() == {"queued": 0, "running": 0, "finished": N}
    # the orphaned commands were killed by the new dispatcher, not left sleeping
    for pid in leftover:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    assert not any(os.path.exists(d) for d in scratch)  # their scratch dirs removed
    assert os.path.exists(db)
