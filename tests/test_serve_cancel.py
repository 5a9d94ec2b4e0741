"""Cancellation through the service: a client that disconnects cancels its request (a
queued one is dropped, a running one killed with its whole process tree), an explicit
cancel (native API, Python client) does the same, and each is recorded as cancelled in
the journal, the trace and ``/metrics``. Processes are looked for in this machine's
process table (``/proc/*/cmdline``), not in the dispatcher's books."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import httpx
import pytest
from serve_helpers import serving

from metasched.client import Client, ServiceError
from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.dispatch.deadline_config import DeadlineConfig
from metasched.runtime.journal import Journal
from metasched.serve import ServeConfig
from metasched.serve.deadlines import DEADLINE_HEADER

N_CLIENTS = 50


def tree(mark: str, seconds: int = 60) -> str:
    """Python code that starts a child and sleeps, both named ``mark`` in their argv."""
    child = f"import time; time.sleep({seconds})"
    return ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', {child!r}, {mark + '-child'!r}])\n"
            f"import os; os.execv(sys.executable, [sys.executable, '-c', {child!r}, "
            f"{mark!r}])\n")


def marked(prefix: str) -> dict[str, int]:
    """Processes alive now whose argv holds a word starting with ``prefix``: pid by
    that word (zombies, already dead, are left out)."""
    found: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for word in argv:
            if word.startswith(prefix.encode()):
                found[word.decode()] = int(entry.name)
    return found


def journal_results(path: Path) -> list[dict]:
    with Journal(path, lock=False) as j:
        rows = j._db.execute("SELECT result FROM requests WHERE result IS NOT NULL").fetchall()
    return [json.loads(r[0]) for r in rows]


def in_flight(url: str) -> int:
    """Actions submitted through the service that have not finished."""
    return httpx.get(f"{url}/v1/status").json()["service"]["in_flight"]


def wait_until(check, timeout_s: float = 30.0, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(every_s)


@pytest.fixture
def served(tmp_path):
    # Two commands hold the two cores and the rest wait: no idle core is lent (the
    # commands sleep) and each caller gives the service time (a deadline far off).
    dcfg = DispatcherConfig(scheduler="elastic_greedy", journal=tmp_path / "j.db",
                            trace=tmp_path / "trace.jsonl", cores=[0, 1],
                            deadlines=DeadlineConfig(idle_share=False))
    with serving(dcfg, ServeConfig(languages=["python"])) as s:
        s.tmp = tmp_path
        yield s


def test_disconnected_clients_are_cancelled_queued_dropped_running_killed(served):
    tag = f"m{uuid.uuid4().hex[:8]}"

    async def clients() -> tuple[float, dict[str, float]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=None,
                                     limits=httpx.Limits(max_connections=N_CLIENTS)) as c:
            tasks = [asyncio.create_task(c.post("/run_code", json={
                "code": tree(f"{tag}-{i}"), "run_timeout": 120},
                headers={DEADLINE_HEADER: "600"}))
                for i in range(N_CLIENTS)]
            # Every request in: two running (the cores), the others waiting behind them
            # (queued, or held until sandbox memory frees for their trajectory).
            await asyncio.to_thread(wait_until, lambda: len(marked(tag)) == 4 and
                                    in_flight(served.url) == N_CLIENTS)
            running = {"-".join(w.split("-")[:2]) for w in marked(tag)}
            t0 = time.monotonic()
            for t in tasks:
                t.cancel()  # the client gives up: its connection closes
            await asyncio.gather(*tasks, return_exceptions=True)
            gone: dict[str, float] = {}

            def settled() -> bool:
                alive = {"-".join(w.split("-")[:2]) for w in marked(tag)}
                for m in running - alive - set(gone):
                    gone[m] = time.monotonic() - t0
                return not alive and in_flight(served.url) == 0

            await asyncio.to_thread(wait_until, settled, 10.0, 0.005)
            return time.monotonic() - t0, gone

    all_gone_s, killed = asyncio.run(clients())
    assert len(killed) == 2 and max(killed.values()) < 1.0, killed
    assert all_gone_s < 1.0
    # The next request runs at once.
    t0 = time.monotonic()
    r = httpx.post(f"{served.url}/run_code", json={"code": "print('next')"}, timeout=30)
    next_s = time.monotonic() - t0
    assert r.json()["run_result"]["stdout"] == "next\n" and next_s < 2.0
    # A killed command's result follows its death (reaped, its pipes drained), which may
    # come after its client's answer and the next request's: wait for the journal.

    def all_cancelled() -> list[dict] | None:
        runs = [r for r in journal_results(served.tmp / "j.db") if r["status"] == "cancelled"]
        return runs if len(runs) == N_CLIENTS else None

    runs = wait_until(all_cancelled, 10.0)
    assert all(r["reason"] == "cancelled" for r in runs)
    # The two that ran, and any step a freed core started before its client's cancel
    # was read (the 50 disconnects arrive one by one), were killed.
    assert sum(r["started_at"] is not None for r in runs) >= 2
    metrics = httpx.get(f"{served.url}/metrics").text
    assert f"metasched_cancelled_total {float(N_CLIENTS)}" in metrics
    assert f'metasched_cancellations_total{{cause="disconnect"}} {float(N_CLIENTS)}' in metrics
    print(f"\ntime to gone (killed): {sorted(killed.values())}, all {all_gone_s:.3f} s, "
          f"next request {next_s:.3f} s, p50 "
          f"{statistics.median(killed.values()):.3f}")


def test_explicit_cancel_through_the_client_and_the_native_api(tmp_path):
    tag = f"e{uuid.uuid4().hex[:8]}"
    sleep = ["python3", "-c", "import time; time.sleep(60)"]
    # The sleepers' cores stay theirs (no idle core lent), so the third one waits.
    dcfg = DispatcherConfig(scheduler="elastic_greedy", journal=tmp_path / "j.db",
                            trace=tmp_path / "trace.jsonl", cores=[0, 1],
                            deadlines=DeadlineConfig(idle_share=False))
    with serving(dcfg) as served, Client(served.url) as c:
        busy = [c.submit(argv=[*sleep, f"{tag}-busy-{i}"]) for i in range(2)]
        queued = c.submit(argv=[*sleep, f"{tag}-queued"])
        wait_until(lambda: len(marked(f"{tag}-busy")) == 2)
        assert c.cancel(queued) == "cancelled"
        assert c.result(queued).status == "cancelled"
        assert c.cancel(busy[0]) == "cancelling"
        assert c.result(busy[0], wait_s=5).status == "cancelled"
        assert set(marked(tag)) == {f"{tag}-busy-1"}
        r = httpx.delete(f"{served.url}/v1/actions/{busy[1]}")
        assert r.json() == {"id": busy[1], "status": "cancelling"}
        assert c.result(busy[1], wait_s=5).status == "cancelled" and not marked(tag)
        assert c.cancel(busy[1]) == "finished"
        with pytest.raises(ServiceError, match="404"):
            c.cancel("no-such-id")
    trace = (tmp_path / "trace.jsonl").read_text().splitlines()[1:]
    measured = [json.loads(line)["measured"] for line in trace]
    assert [m["status"] for m in measured] == ["cancelled"] * 3
    assert sorted(m.get("exit_code", 0) for m in measured) == [-9, -9, 0]
    # Finished in the journal: a restart does not run them again.
    assert {r["id"]: r["status"] for r in journal_results(tmp_path / "j.db")} == dict.fromkeys(
        [*busy, queued], "cancelled")
    with Journal(tmp_path / "j.db", lock=False) as j:
        assert j.unfinished() == []


def test_only_the_owner_may_cancel():
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
    with serving(config=ServeConfig(tokens=tokens, languages=[])) as s:
        alice, bob = (Client(s.url, token=t) for t in tokens.values())
        rid = alice.submit(argv=["sleep", "30"])
        with pytest.raises(ServiceError, match="404"):
            bob.cancel(rid)
        assert alice.cancel(rid) in ("cancelled", "cancelling")
        assert alice.result(rid, wait_s=5).status == "cancelled"
