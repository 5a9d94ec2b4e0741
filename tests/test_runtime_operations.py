"""The dispatcher's operational guarantees, on real processes and a real journal: one
dispatcher per journal, resubmissions checked against the stored requests, env values
kept out of the journal unless asked, finished rows compactable, and settings or
requests that cannot work rejected in one line before anything runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import COMMAND_PY, cpu
from helpers import dispatcher_config as cfg

from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher
from metasched.runtime.journal import Journal, JournalLocked
from metasched.runtime.journal_rows import StoredRequest
from metasched.runtime.requests import MAX_SECONDS
from metasched.runtime.sandbox.config import SandboxConfig

PY = sys.executable  # runs dispatcher processes
CMD_PY = COMMAND_PY  # what commands run: a sandbox's user can (see helpers)


# ------------------------------------------------------------------ one dispatcher per journal

# A dispatcher in its own process that starts a long command, then serves until killed.
FIRST = textwrap.dedent("""
    import asyncio, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig

    async def main(db):
        cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db)
        async with Dispatcher(cfg) as d:
            d.accept({"id": "long", "kind": "cpu", "argv": ["sleep", "60"], "timeout_s": 120})
            while not d.journal.orphans():
                await asyncio.sleep(0.01)
            print("running", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1]))
""")


@pytest.mark.subprocess
def test_a_second_dispatcher_on_a_live_journal_fails_and_leaves_the_first_alone(tmp_path):
    db = tmp_path / "journal.db"
    first = subprocess.Popen([PY, "-c", FIRST, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "running"
        with Journal(db, lock=False) as j:
            (key, pid), = j.orphans()
        assert key == "long" and psutil.pid_exists(pid)
        with pytest.raises(JournalLocked) as info:
            Dispatcher(cfg(journal=db))
        assert info.value.holder == first.pid
        assert str(info.value) == (f"journal: {db} is in use by another dispatcher (pid "
                                   f"{first.pid}); stop it first, or choose another journal")
        time.sleep(0.2)
        # Its command still runs: the second one failed before recovery could kill it.
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert first.poll() is None
    finally:
        first.kill()
        first.wait(30)
        first.stdout.close()
        psutil.Process(pid).kill()


# ------------------------------------------------------------------ resubmissions


async def test_the_same_id_with_another_request_is_rejected_while_it_runs():
    async with Dispatcher(cfg()) as d:
        a = d.accept(cpu(CMD_PY, "-c", "import time; time.sleep(0.3); print('a')", id="x"))
        same = d.accept(cpu(CMD_PY, "-c", "import time; time.sleep(0.3); print('a')", id="x"))
        other = d.accept(cpu(CMD_PY, "-c", "print('b')", id="x"))
        other, first = await other, await a
    assert same is a  # deduplicated: the first's future
    assert other.status == "rejected" and other.reason == (
        "id: 'x' was accepted before with a different request; give this one another id "
        "(or, to start over, use a new journal)")
    assert first.ok and first.stdout == "a\n"


async def test_a_resubmission_must_match_the_stored_request(tmp_path):
    db = tmp_path / "j.db"
    req = cpu(CMD_PY, "-c", "print('first')", id="k", env={"A": "1"})

    async def first():
        async with Dispatcher(cfg(journal=db)) as d:
            return await d.submit(req)

    async def again(*requests):
        async with Dispatcher(cfg(journal=db)) as d:
            return [await d.submit(r) for r in requests]

    r = await first()
    assert r.ok and r.stdout == "first\n"
    reordered = {k: req[k] for k in reversed(list(req))}  # field order does not matter
    same, other_env, other_argv = await again(
          reordered, {**req, "env": {"A": "2"}}, {**req, "argv": [CMD_PY, "-c", "print('x')"]})
    assert same.ok and same.stdout == "first\n" and same.finished_at == r.finished_at
    for out in (other_env, other_argv):
        assert out.status == "rejected" and out.reason == (
            "id: 'k' was accepted before with a different request; give this one another "
            "id (or, to start over, use a new journal)")


# ------------------------------------------------------------------ env values


KILLED = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig

    async def main(db, keep_env, reqs):
        cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db,
                               journal_env=keep_env == "1")
        async with Dispatcher(cfg) as d:
            for r in json.loads(reqs):
                d.accept(r)
            d.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # accepted, nothing finished

    asyncio.run(main(*sys.argv[1:]))
""")


@pytest.mark.subprocess
@pytest.mark.parametrize("keep_env", [False, True])
async def test_env_values_stay_out_of_the_journal_unless_asked(tmp_path, visible_dir, keep_env):
    db = tmp_path / "j.db"
    secret = "s3cr3t-value"
    gate = visible_dir / "gate"
    with_env = cpu("/bin/sh", "-c", 'test -e "$0" && echo "$SECRET"', str(gate), id="env",
                   env={"SECRET": secret, "PATH": os.environ["PATH"]})
    plain = cpu("/bin/sh", "-c", 'test -e "$0" && echo plain', str(gate), id="plain")
    p = subprocess.run([PY, "-c", KILLED, str(db), str(int(keep_env)),
                        json.dumps([with_env, plain])], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == -9, p.stderr
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("j.db*") if f.is_file())
    assert (secret.encode() in raw) is keep_env
    with Journal(db) as j:
        stored = StoredRequest.parse(j.row("env")[0])
    assert stored.env_withheld == (() if keep_env else ("PATH", "SECRET"))
    gate.write_text("")

    async def restart(resubmit):  # the gate lies where sandboxed commands see it
        seen = SandboxConfig(system_paths=(str(visible_dir),))
        async with Dispatcher(cfg(journal=db, sandbox=seen)) as d:
            waiting = d.awaiting_resubmission
            return waiting, await asyncio.gather(*(d.accept(r) for r in resubmit))

    waiting, _ = await restart([])  # closing drains what was recovered and could run
    # Without its env the request cannot run as given: it waits for its resubmission.
    assert waiting == ([] if keep_env else ["env"])
    with Journal(db) as j:
        assert j.status("plain") == "finished"
        assert j.status("env") == ("finished" if keep_env else "queued")
    waiting, (out,) = await restart([with_env])
    assert out.ok and out.stdout == f"{secret}\n" and out.attempts == 1
    wrong = {**with_env, "env": {"SECRET": "other", "PATH": os.environ["PATH"]}}
    (rejected,) = (await restart([wrong]))[1]
    assert rejected.status == "rejected" and "different request" in rejected.reason


@pytest.mark.subprocess
async def test_a_withheld_env_resubmitted_with_other_values_is_rejected(tmp_path):
    db = tmp_path / "j.db"
    req = cpu("/bin/echo", "x", id="e", env={"TOKEN": "right"})
    p = subprocess.run([PY, "-c", KILLED, str(db), "0", json.dumps([req])],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr

    async def restart(r):
        async with Dispatcher(cfg(journal=db)) as d:
            out = await d.accept(r)
            return out, d.awaiting_resubmission
    out, waiting = await restart({**req, "env": {"TOKEN": "wrong"}})
    assert out.status == "rejected" and "accepted before with a different request" in out.reason
    assert waiting == ["e"]  # still waiting for the real one
    out, waiting = await restart(req)
    assert out.ok and out.stdout == "x\n" and waiting == []


# ------------------------------------------------------------------ compaction


async def test_compacted_rows_keep_their_ids_and_outcomes(tmp_path):
    db = tmp_path / "j.db"
    reqs = [cpu(CMD_PY, "-c", f"print('{'y' * 500}')", id=f"r{i}") for i in range(20)]

    async def go(requests, compact):
        async with Dispatcher(cfg(journal=db)) as d:
            out = [await d.submit(r) for r in requests]
            n = d.compact_journal(0) if compact else None
            return out, n, d.state.n_submitted

    first, n, _ = await go(reqs, True)
    assert all(r.ok and len(r.stdout) == 501 for r in first) and n == 20
    with Journal(db) as j:
        request, state, result = j.row("r3")
    assert state == "finished" and "yyy" not in request + result
    assert json.loads(request)["compacted"] is True
    again, n, submitted = await go(reqs[:3] + [{**reqs[3], "argv": ["true"]}], True)
    assert submitted == 0 and n == 0  # answered from the journal; nothing left to compact
    assert [r.status for r in again] == ["done"] * 3 + ["rejected"]
    assert again[0].exit_code == 0 and again[0].stdout == ""  # the outcome, not the output
    assert again[0].finished_at == first[0].finished_at


# ------------------------------------------------------------------ bad settings and numbers


async def test_a_journal_damaged_inside_is_a_config_error_at_start(tmp_path):
    """Header intact, table pages overwritten: the open-time checks pass, recovery's
    read of the unfinished requests finds the damage, and says so in one line."""
    db = tmp_path / "j.db"
    with Journal(db) as j:
        j.accept_many([(f"k{i}", json.dumps({"queued_at": 1.0, "request": {}, "x": "y" * 300}))
                       for i in range(500)])
        j._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[2 * page:] = b"\xff" * (len(data) - 2 * page)  # every page after the second
    db.write_bytes(bytes(data))

    with pytest.raises(ConfigError) as info:
        async with Dispatcher(cfg(journal=db)):
            pass
    msg = str(info.value)
    assert msg.startswith(f"journal: {db}: unreadable (") and "\n" not in msg, msg
    Journal(db, lock=True).close()  # the failed start released the lock


@pytest.mark.parametrize("workdir, why", [
    ("/nonexistent", "no such directory"),
    ("/proc/1", "No such file or directory"),  # exists, but nothing can be made there
    (__file__, "Not a directory"),
])
def test_an_unusable_workdir_is_a_config_error_before_anything_runs(workdir, why):
    with pytest.raises(ConfigError, match=rf"^workdir: {workdir}: cannot make scratch "
                                          rf"directories there \(({why})\)$"):
        Dispatcher(cfg(workdir=workdir))


@pytest.mark.parametrize("field, value, message", [
    ("mem_limit_mb", 1e300, "mem_limit_mb: must be <= "),
    ("mem_limit_mb", 2**40, "(MiB: this machine's memory; got 1.09951e+12)"),
    ("timeout_s", 1e300, f"timeout_s: must be <= {MAX_SECONDS:.0f} (30 days; got 1e+300)"),
    ("timeout_s", float("inf"), "timeout_s: must be a finite number"),
    ("cpu_time_s", 1e12, "cpu_time_s: must be <= 2592000"),
    ("est_s", 1e9, "est_s: must be <= 2592000"),
    ("turn", 1e300, "turn: must be <= 1000000"),
])
async def test_absurd_numbers_are_rejected_naming_the_field(field, value, message):
    async with Dispatcher(cfg()) as d:
        r = await d.submit(cpu("true", **{field: value}))
    assert r.status == "rejected" and message in r.reason and "\n" not in r.reason, r.reason
