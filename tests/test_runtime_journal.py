"""The request journal: round trips, idempotent accepts, state transitions, reopening,
durability across kill -9 of the writing process, and refusing foreign files."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metasched.runtime.journal import SCHEMA_VERSION, Journal

ROOT = Path(__file__).resolve().parents[1]


def _req(i: int) -> str:
    return json.dumps({"kind": "api", "endpoint": "search", "q": f"query {i}"})


def test_round_trip(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        assert j.accept("a", _req(1)) == (True, 1)
        assert j.status("a") == "queued" and j.result("a") is None
        j.started("a", pid=4321)
        assert j.status("a") == "running"
        assert j.orphans() == [("a", 4321)]
        j.finished("a", '{"ok": true}')
        assert j.status("a") == "finished" and j.result("a") == '{"ok": true}'
        assert j.orphans() == [] and j.unfinished() == []
        assert j.status("nope") is None and j.result("nope") is None


def test_accept_is_idempotent(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        assert j.accept("a", _req(1)) == (True, 1)
        assert j.accept("b", _req(2)) == (True, 2)
        j.started("a")
        assert j.accept("a", "something else") == (False, 1)
        assert j.status("a") == "running"  # unchanged by the repeat
        assert j.unfinished() == [("a", _req(1), 1), ("b", _req(2), 0)]
        assert j.counts() == {"queued": 1, "running": 1, "finished": 0}


def test_accept_many(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.accept("x", _req(0))
        out = j.accept_many([("a", _req(1)), ("x", "dup"), ("b", _req(2)), ("a", "again")])
        assert out == [(True, 2), (False, 1), (True, 3), (False, 2)]
        assert j.accept_many([]) == []
        assert [k for k, _, _ in j.unfinished()] == ["x", "a", "b"]
        assert j.unfinished()[1][1] == _req(1)


def test_accept_many_is_all_or_nothing(tmp_path: Path) -> None:
    def items():
        yield "a", _req(1)
        yield "b", None  # NOT NULL: the insert fails midway

    with Journal(tmp_path / "j.db") as j:
        with pytest.raises(sqlite3.IntegrityError):
            j.accept_many(items())  # type: ignore[arg-type]
        assert j.status("a") is None and j.counts()["queued"] == 0
        assert j.accept("c", _req(3))[0]  # the journal is usable afterwards


def test_state_transitions_and_attempts(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.accept_many([(k, _req(i)) for i, k in enumerate("abc")])
        j.started("a", pid=100)
        j.started("a", pid=101)  # a retry after a crash: another attempt, new group
        j.started("b", attempt=5)
        j.finished("c", '"skipped"')  # queued -> finished directly (e.g. rejected)
        assert j.unfinished() == [("a", _req(0), 2), ("b", _req(1), 5)]
        assert j.orphans() == [("a", 101)]  # b runs without a process group
        with pytest.raises(KeyError):
            j.started("zzz")
        with pytest.raises(KeyError):
            j.finished("zzz", "null")
        with pytest.raises(ValueError, match="already finished"):
            j.started("c")
        with pytest.raises(ValueError, match="already finished"):
            j.finished("c", '"again"')
        assert j.result("c") == '"skipped"'  # the first result stands


def _row(j: Journal, key: str) -> tuple:
    return sqlite3.connect(j.path).execute(
        "SELECT state, attempts, pid, started_at, finished_at, result FROM requests "
        "WHERE key = ?", (key,)).fetchone()


def test_record_matches_the_single_row_writes(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.accept_many([(k, _req(i)) for i, k in enumerate("abcde")])
        j.started("e", pid=7)
        j.finished("e", '"done before"')
        with j.batch():
            skipped = j.record(
                started=[("a", 100, 1, 10.0), ("b", None, None, 11.0)],
                finished=[("c", '"c"', 12.0)],
                started_finished=[("d", 3, 13.0, '"d"', 14.0)])
        assert skipped == 0
        assert _row(j, "a") == ("running", 1, 100, 10.0, None, None)
        assert _row(j, "b") == ("running", 1, None, 11.0, None, None)  # attempt None: +1
        assert _row(j, "c")[0::5] == ("finished", '"c"') and _row(j, "c")[4] == 12.0
        # a start and its finish in one update: attempts and start time recorded too
        assert _row(j, "d") == ("finished", 3, None, 13.0, 14.0, '"d"')
        assert j.orphans() == [("a", 100)]
        # unknown or finished keys are counted, not raised, and change nothing
        assert j.record([("zzz", 1, 1, 1.0)], [("e", '"again"', 1.0)],
                        [("e", 1, 1.0, '"again"', 2.0)]) == 3
        assert j.result("e") == '"done before"'
        assert j.record([], []) == 0


def test_unfinished_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "j.db"  # parents are created
    with Journal(path) as j:
        j.accept_many([(f"k{i}", _req(i)) for i in range(10)])
        for i in range(0, 10, 3):
            j.started(f"k{i}", pid=1000 + i)
        for i in range(0, 10, 2):
            j.finished(f"k{i}", json.dumps(i))
        before = j.unfinished()
    with Journal(path) as j:
        assert j.unfinished() == before
        assert [k for k, _, _ in before] == [f"k{i}" for i in (1, 3, 5, 7, 9)]
        assert j.orphans() == [("k3", 1003), ("k9", 1009)]
        assert j.counts() == {"queued": 3, "running": 2, "finished": 5}
        assert j.accept("k10", _req(10)) == (True, 11)  # seq continues after reopen
        assert j.result("k4") == "4"


def test_pragmas(tmp_path: Path) -> None:
    with Journal(tmp_path / "a.db") as j:
        assert j._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert j._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with Journal(tmp_path / "b.db", fsync=True) as j:
        assert j._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        j.accept("a", "{}")
    with Journal(tmp_path / "b.db") as j:  # fsync is per connection, not in the file
        assert j.status("a") == "queued"


def test_close_is_idempotent(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db")
    j.close()
    j.close()
    with pytest.raises(sqlite3.ProgrammingError):
        j.accept("a", "{}")


def test_other_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    Journal(path).close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 98}")
    with pytest.raises(ValueError) as info:
        Journal(path)
    msg = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 98}" in msg and "move the file" in msg
    assert "\n" not in msg


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(ValueError, match="not a metasched journal"):
        Journal(other)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(ValueError, match="not a journal"):
        Journal(junk)


# --- durability across kill -9 -----------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from metasched.runtime.journal import Journal
    j = Journal(sys.argv[1])
    for i in range(1500):
        assert j.accept(f"k{i}", json.dumps({"i": i})) == (True, i + 1)
    for i in range(0, 1000):
        j.started(f"k{i}", pid=50000 + i)
    for i in range(0, 500):
        j.finished(f"k{i}", json.dumps({"r": i}))
    j.accept_many([(f"m{i}", "{}") for i in range(100)])
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handlers
""")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_survives_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=_child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert Path(f"{path}-wal").exists()  # the commits were still in the WAL, unmerged
    with Journal(path) as j:
        assert j.counts() == {"queued": 600, "running": 500, "finished": 500}
        for i in range(1500):
            want = "finished" if i < 500 else "running" if i < 1000 else "queued"
            assert j.status(f"k{i}") == want
        assert j.result("k7") == json.dumps({"r": 7})
        assert j.orphans() == [(f"k{i}", 50000 + i) for i in range(500, 1000)]
        unfinished = j.unfinished()
        assert [k for k, _, _ in unfinished] == (
            [f"k{i}" for i in range(500, 1500)] + [f"m{i}" for i in range(100)])
        assert unfinished[0] == ("k500", json.dumps({"i": 500}), 1)


_STREAM = textwrap.dedent("""
    import sys
    from metasched.runtime.journal import Journal
    j = Journal(sys.argv[1])
    for i in range(10**6):
        j.accept(f"k{i}", "{}")
        sys.stdout.write(f"{i}\\n")  # the ack: written only after accept() returned
        sys.stdout.flush()
""")


def test_every_ack_survives_kill_9_mid_stream(tmp_path: Path) -> None:
    """Killed by another process at an arbitrary point: each key it acknowledged is
    in the journal, and nothing beyond the one it may have been writing."""
    path = tmp_path / "j.db"
    proc = subprocess.Popen([sys.executable, "-c", _STREAM, str(path)], env=_child_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = -1
    try:
        for line in proc.stdout:
            acked = int(line)
            if acked >= 1200:
                break
    finally:
        proc.kill()  # SIGKILL
        proc.wait(timeout=30)
        proc.stdout.close()
    assert acked >= 1200
    with Journal(path) as j:
        counts = j.counts()
        assert all(j.status(f"k{i}") == "queued" for i in range(acked + 1))
        # Only acks still in the pipe (and the key being written) can lie beyond.
        assert counts["queued"] >= acked + 1
        assert [k for k, _, _ in j.unfinished()] == [f"k{i}" for i in range(counts["queued"])]


# --- a model check -----------------------------------------------------------------

_ops = st.lists(st.tuples(st.sampled_from(["accept", "start", "finish", "reopen"]),
                          st.integers(0, 5)), max_size=25)


@settings(max_examples=30)
@given(_ops)
def test_matches_a_dict_model(ops: list[tuple[str, int]]) -> None:
    """Any sequence of operations (with reopenings) leaves the journal agreeing with a
    plain in-memory model."""
    model: dict[str, list] = {}  # key -> [seq, state, attempts, result]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j.db"
        j = Journal(path)
        try:
            for op, n in ops:
                key = f"k{n}"
                if op == "reopen":
                    j.close()
                    j = Journal(path)
                elif op == "accept":
                    new = key not in model
                    if new:
                        model[key] = [len(model) + 1, "queued", 0, None]
                    assert j.accept(key, _req(n)) == (new, model[key][0])
                elif op == "start":
                    if key not in model:
                        with pytest.raises(KeyError):
                            j.started(key)
                    elif model[key][1] == "finished":
                        with pytest.raises(ValueError):
                            j.started(key)
                    else:
                        j.started(key, pid=n)
                        model[key][1:3] = ["running", model[key][2] + 1]
                else:
                    if key not in model:
                        with pytest.raises(KeyError):
                            j.finished(key, "1")
                    elif model[key][1] == "finished":
                        with pytest.raises(ValueError):
                            j.finished(key, "2")
                    else:
                        j.finished(key, str(n))
                        model[key][1], model[key][3] = "finished", str(n)
            order = sorted(model, key=lambda k: model[k][0])
            assert j.unfinished() == [(k, _req(int(k[1:])), model[k][2]) for k in order
                                      if model[k][1] != "finished"]
            assert j.orphans() == [(k, int(k[1:])) for k in order if model[k][1] == "running"]
            for k, (_, state, _, result) in model.items():
                assert j.status(k) == state and j.result(k) == result
            counts = {s: sum(v[1] == s for v in model.values())
                      for s in ("queued", "running", "finished")}
            assert j.counts() == counts
        finally:
            j.close()


# --- one writer, owner-only files, bad files ----------------------------------------

_HOLD = textwrap.dedent("""
    import sys, time
    from metasched.runtime.journal import Journal
    j = Journal(sys.argv[1])
    j.accept("held", "{}")
    print("holding", flush=True)
    time.sleep(3600)
""")


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    from metasched.runtime.journal import JournalLocked

    path = tmp_path / "j.db"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], env=_child_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(JournalLocked) as info:
            Journal(path)
        msg = str(info.value)
        assert info.value.holder == holder.pid and f"(pid {holder.pid})" in msg
        assert msg.startswith(f"journal: {path} is in use by another dispatcher")
        assert "\n" not in msg
        with Journal(path, lock=False) as reader:  # readers are welcome meanwhile
            assert reader.status("held") == "queued"
        holder.send_signal(signal.SIGKILL)  # a dead holder leaves no stale lock
        holder.wait(30)
        with Journal(path) as j:
            assert j.status("held") == "queued"
            assert (tmp_path / "j.db.lock").read_text() == f"{os.getpid()}\n"
    finally:
        holder.kill()
        holder.stdout.close()
    Journal(path).close()  # closing released the lock


def test_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with Journal(tmp_path / "new.db") as j:
            j.accept("a", "{}")
            made = sorted(tmp_path.iterdir())
            assert [p.name for p in made] == ["new.db", "new.db-shm", "new.db-wal",
                                              "new.db.lock"]
            assert {p.name: oct(p.stat().st_mode & 0o777) for p in made} == dict.fromkeys(
                (p.name for p in made), "0o600")
        wide = tmp_path / "wide.db"
        Journal(wide).close()
        wide.chmod(0o644)  # e.g. made by an older metasched
        Journal(wide).close()
        assert oct(wide.stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)


@pytest.mark.parametrize("damage, message", [
    ("empty", "empty (0 bytes): not a journal"),
    ("truncated", "truncated ("),
    ("text", "not an SQLite file"),
    ("directory", "is a directory"),
])
def test_unusable_files_are_one_line_errors(tmp_path: Path, damage: str, message: str
                                            ) -> None:
    from metasched.errors import ConfigError

    path = tmp_path / "j.db"
    if damage == "empty":
        path.touch()
    elif damage == "truncated":
        with Journal(path) as j:
            j.accept_many([(f"k{i}", json.dumps({"x": "y" * 200})) for i in range(2000)])
            j._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # all of it in the file
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "text":
        path.write_text("{\"kind\": \"cpu\"}\n")
    else:
        path.mkdir()
    with pytest.raises(ConfigError) as info:
        Journal(path)
    msg = str(info.value)
    assert msg.startswith(f"journal: {path}: {message}") and "\n" not in msg, msg
    if damage != "directory":
        assert path.stat().st_size == (0 if damage == "empty" else path.stat().st_size)


def test_compact_rewrites_old_finished_rows_and_keeps_their_ids(tmp_path: Path) -> None:
    def shrink(request: str, result: str) -> tuple[str, str]:  # idempotent, as it must be
        doc = json.loads(result)
        return "{}", json.dumps({"kept": doc.get("status", doc.get("kept"))})

    with Journal(tmp_path / "j.db") as j:
        j.accept_many([(f"k{i}", json.dumps({"big": "x" * 1000})) for i in range(30)])
        for i in range(20):
            j.finished(f"k{i}", json.dumps({"status": "done", "stdout": "y" * 1000}))
        assert j.compact(3600, shrink) == 0  # none finished an hour ago
        assert j.compact(0, shrink, batch=7) == 20
        assert j.compact(0, shrink) == 0  # already compact: nothing rewritten
        assert j.row("k3") == ("{}", "finished", '{"kept": "done"}')
        assert j.row("k25") == (json.dumps({"big": "x" * 1000}), "queued", None)
        assert j.row("nope") is None
        assert j.accept("k3", "{}") == (False, 4)  # the id is still known
        assert j.counts() == {"queued": 10, "running": 0, "finished": 20}
        size = j.path.stat().st_size
        j.compact(0, shrink, vacuum=True)
        assert j.path.stat().st_size <= size
        with pytest.raises(ValueError, match="older_than_s"):
            j.compact(-1, shrink)
