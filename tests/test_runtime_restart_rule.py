"""What a dispatcher restarted on a journal does with the requests a dead one left
(the rows are written as a dispatcher that died would have left them): by each one's
``on_restart`` it cancels them (their callers' connections died) or runs them again,
with ``deadlines.recovered_s`` to start; their trajectories end once their recovered
actions have; rows an older version wrote that no longer validate are finished failed
and reported, never fatal."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.journal import Journal
from metasched.runtime.journal_rows import digest
from metasched.runtime.sandbox.config import SandboxConfig

pytestmark = pytest.mark.subprocess


def _row(request: dict, queued_at: float) -> str:
    """A journal row's text as a dispatcher writes it."""
    return json.dumps({"queued_at": queued_at, "digest": digest(request), "request": request})


def _leave(db: Path, rows: dict[str, str], running: tuple[str, ...] = ()) -> None:
    """The journal a dead dispatcher left: ``rows`` accepted, ``running`` started."""
    with Journal(db) as j:
        for key, text in rows.items():
            j.accept(key, text)
        for key in running:
            j.started(key, pid=None)


def _config(db: Path, **kw) -> DispatcherConfig:
    return DispatcherConfig(scheduler="elastic_greedy", journal=str(db), sample_interval_s=0.1,
                            sandbox=SandboxConfig(isolation="none"), **kw)


async def test_restart_cancels_or_reruns_by_on_restart(tmp_path, caplog):
    db = tmp_path / "journal.db"
    then = time.time() - 30
    long_id = "x" * 300  # ids were not bounded before: this version refuses such a one
    rows = {
        "gone": _row({"kind": "cpu", "id": "gone", "argv": ["true"], "trajectory": "a",
                      "on_restart": "cancel"}, then),
        "back": _row({"kind": "cpu", "id": "back", "argv": ["true"], "trajectory": "b"}, then),
        long_id: _row({"kind": "cpu", "id": long_id, "argv": ["true"]}, then),
        "torn": "{not json",
        "odd": json.dumps({"queued_at": then, "request": ["not", "a", "dict"]}),
    }
    _leave(db, rows, running=("gone", "back"))
    caplog.set_level(logging.INFO, "metasched.dispatch")
    async with Dispatcher(_config(db)) as d:
        for _ in range(250):  # the rerun's trajectory ends once its action has
            if not d.trajectories.by_name and not len(d.jobs):
                break
            await asyncio.sleep(0.02)
        assert d.trajectories.by_name == {}
    with Journal(db) as j:
        got = {k: json.loads(j.result(k)) for k in ("gone", "back")}
        assert got["gone"]["status"] == "cancelled"
        assert got["gone"]["reason"].startswith("restart:")
        assert got["back"]["status"] == "done" and got["back"]["attempts"] == 2
        assert j.counts() == {"queued": 0, "running": 0, "finished": len(rows)}
        for key in (long_id, "torn", "odd"):
            assert json.loads(j.result(key))["status"] == "failed"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "could not be recovered" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("journal: 3 requests"), warned


async def test_recovered_command_gets_a_deadline(tmp_path):
    db = tmp_path / "journal.db"
    then = time.time() - 30
    rows = {f"r{i}": _row({"kind": "cpu", "id": f"r{i}", "argv": ["sleep", "3"],
                           "timeout_s": 10}, then) for i in range(2)}
    _leave(db, rows)
    cfg = _config(db, cores=[0], deadlines={"recovered_s": 0.5, "idle_share": False})
    async with Dispatcher(cfg) as d:
        while len(d.jobs):
            await asyncio.sleep(0.05)
    with Journal(db) as j:
        first, second = (json.loads(j.result(k)) for k in rows)
    # One core: the first runs; the second is refused at its deadline, not after the first.
    assert first["status"] == "done"
    assert second["status"] == "failed" and second["reason"].startswith(
        "deadline: not started within 0.5 s of the restart"), second["reason"]
    assert second["finished_at"] < first["finished_at"] - 1
