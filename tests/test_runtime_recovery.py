"""Durability: kill -9 of a dispatcher with over 1,000 accepted, unfinished requests; a
new dispatcher on the same journal completes every one of them, runs again only those
that were running, kills what the dead one left and removes what it made, and nothing
else (a user's directory named like the dispatcher's, even one an orphan had made its
working directory, stays). With isolation and without."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.journal import Journal
from metasched.runtime.sandbox.config import SandboxConfig

pytestmark = pytest.mark.subprocess

N = 1200
RUNNING = "running"

# The child dispatcher accepts N requests, then serves them until it is killed. Each
# request waits for the gate file (so few finish before the kill) and exits at once when
# it exists (so the restarted dispatcher completes them quickly). Without isolation each
# command first enters the user's directory (the case where recovery once removed it).
CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig

    async def main(db, workdir, isolation, requests, seen):
        sandbox = SandboxConfig(isolation=isolation, system_paths=(seen,))
        cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db, sample_interval_s=0.1,
                               workdir=workdir, sandbox=sandbox)
        async with Dispatcher(cfg) as d:
            for r in json.loads(open(requests).read()):
                d.accept(r)
            d.flush()  # durable now (otherwise at the end of this loop turn)
            print("accepted", d.backend.run_dir.path, flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
""")


def requests(gate: str, user_dir: str, isolation: str) -> list[dict]:
    enter = "" if isolation == "bwrap" else f'cd "{user_dir}" && '
    script = enter + f'test -e "{gate}" || sleep 60'
    return [{"id": f"r{i}", "kind": "cpu", "timeout_s": 120, "argv": ["/bin/sh", "-c", script]}
            for i in range(N)]


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=pytest.mark.isolation),
                                       "none"])
async def test_kill_9_loses_nothing_and_removes_only_its_own(tmp_path, visible_dir, isolation):
    db = tmp_path / "journal.db"
    workdir = tmp_path / "shm"  # the dispatcher's run directories go here
    workdir.mkdir()
    gate = str(visible_dir / "gate")  # where sandboxed commands see it
    # Directories that look like the dispatcher's but are a user's.
    user_dir = workdir / "metasched-999-0"
    user_dir.mkdir()
    (user_dir / "precious").write_text("keep")
    lookalike = workdir / "metasched-run-1-abcd"  # a run directory's name, no marker
    lookalike.mkdir()
    reqs = requests(gate, str(user_dir), isolation)
    (tmp_path / "requests.json").write_text(json.dumps(reqs))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db), str(workdir), isolation,
         str(tmp_path / "requests.json"), str(visible_dir)], stdout=subprocess.PIPE,
        text=True)
    try:
        word, dead_run = child.stdout.readline().split()
        assert word == "accepted"
        # Until the running actions have recorded their pids (read beside the live
        # writer, which holds the journal's lock).
        with Journal(db, lock=False) as j:
            for _ in range(400):
                if len(j.orphans()) >= 1:
                    break
                await asyncio.sleep(0.05)
            orphans = j.orphans()
            counts = j.counts()
            state = {f"r{i}": j.status(f"r{i}") for i in range(N)}
        assert counts["finished"] == 0 and counts["queued"] + counts["running"] == N
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    assert orphans, "the killed dispatcher left running commands in its journal"
    in_flight = {k for k, s in state.items() if s == RUNNING}
    assert 1 <= len(in_flight) <= len(os.sched_getaffinity(0))
    # Its commands died with it, before any restart: sandboxed ones with their pid
    # namespaces, host ones by its lifeline.
    _wait_gone([pid for _, pid in orphans])
    assert os.path.isdir(dead_run)

    open(gate, "w").close()

    cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db, workdir=str(workdir),
                           sample_interval_s=0.1,
                           sandbox=SandboxConfig(isolation=isolation,
                                                 system_paths=(str(visible_dir),)))
    async with Dispatcher(cfg) as d:
        futs = [d.accept(r) for r in reqs]  # resubmitted: deduplicated by id
        results, submitted = await asyncio.gather(*futs), d.state.n_submitted
    assert submitted == N  # re-queued from the journal; the resubmissions were deduplicated
    assert [r.status for r in results] == ["done"] * N, {r.reason for r in results}
    assert {r.id for r in results} == {f"r{i}" for i in range(N)}
    # ran again only if it was running when the dispatcher died
    assert {r.id for r in results if r.attempts == 2} == in_flight
    assert all(r.attempts == 1 for r in results if r.id not in in_flight)
    with Journal(db) as j:
        assert j.counts() == {"queued": 0, "running": 0, "finished": N}
    _wait_gone([pid for _, pid in orphans])  # the orphans were killed, not left sleeping
    assert not os.path.exists(dead_run)  # the dead dispatcher's run directory is removed
    assert (user_dir / "precious").read_text() == "keep"  # the user's directories stay
    assert lookalike.is_dir()
    # nothing else is left: the restarted dispatcher removed its own run directory too
    assert sorted(os.listdir(workdir)) == ["metasched-999-0", "metasched-run-1-abcd"]
    assert os.path.exists(db)


def _wait_gone(pids: list[int]) -> None:
    for _ in range(200):
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes {alive} are still running")
