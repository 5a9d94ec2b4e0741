"""A durable SQLite journal of accepted requests: an accepted request is never lost when
the dispatcher process dies (kill -9 included).

The dispatcher acknowledges a request only after :meth:`Journal.accept` returns, which
is after the row is committed. On restart, :meth:`Journal.unfinished` lists what to run
again (in acceptance order) and :meth:`Journal.orphans` the process groups a crashed run
left behind, to kill before re-running.

Durability: the database is in WAL mode. By default ``synchronous=NORMAL``: a commit is
a ``write()`` into the WAL, which is in the OS page cache once ``write()`` returns, so it
survives the death of the process, though not a power loss or a kernel crash (the WAL is
fsync'ed only at checkpoints). ``fsync=True`` selects ``synchronous=FULL``, which
fsyncs the WAL on every commit: durable against power loss, at the price of one fsync
(about a millisecond on a good SSD, far more on network storage) per call.

Threading: use a Journal only from the thread that opened it (sqlite3's
``check_same_thread`` enforces it). The dispatcher opens it on its asyncio thread and
calls it there; each call is tens of microseconds, too short to be worth a thread hop.
Another thread or process that wants to read may open its own Journal on the same file
(WAL lets readers run alongside the one writer).

One writer: a Journal opened for writing (``lock=True``, the default) holds an exclusive
``flock`` on ``<path>.lock`` beside the file until it is closed (or its process dies:
the kernel drops the lock, so a kill -9 leaves no stale lock). A second writer fails at
once with the holder's pid. Readers (``lock=False``) may open it alongside.

Permissions: the file, its ``-wal`` / ``-shm`` files (SQLite gives them the file's mode)
and the lock file are readable and writable by their owner only (0600): requests carry
commands and their results carry output.

Bad files are refused with one line naming the file (:class:`ConfigError`, field
``journal``): one that is not SQLite, an SQLite file that is not a journal, another
schema version, a file shorter than its own header says (truncated), and a 0-byte file
(an empty file is not taken for a new journal: a journal is never empty, so it was
truncated or is not one). Damage found later, while reading, is reported the same way.

Rows are never deleted (``seq`` is the rowid, so it would otherwise be reusable): a
finished id must stay known so that a resubmission is answered, not run again. The file
grows by roughly the size of each request and result; :meth:`Journal.compact` shrinks
the stored texts of old finished rows, keeping their ids.

The file's schema, creation, checks and lock are :mod:`.journal_file`'s.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from metasched.runtime.journal_file import (
    _SCHEMA,
    SCHEMA_VERSION,
    STATES,
    JournalLocked,
    _bad,
    _create,
    _header_problem,
    _lock,
    _owner_only,
)

# Statements as constants: sqlite3 caches prepared statements by their text, so each is
# compiled once per connection.
_INSERT = ("INSERT INTO requests (key, request, state, accepted_at) VALUES (?, ?, 'queued', ?) "
           "ON CONFLICT (key) DO NOTHING")
_SEQ = "SELECT seq FROM requests WHERE key = ?"
_START = ("UPDATE requests SET state = 'running', attempts = COALESCE(?, attempts + 1), "
          "pid = ?, started_at = ? WHERE key = ? AND state != 'finished'")
_FINISH = ("UPDATE requests SET state = 'finished', result = ?, pid = NULL, finished_at = ? "
           "WHERE key = ? AND state != 'finished'")
# A finish that also records its start (the start was not written yet: see ``record``).
_START_FINISH = ("UPDATE requests SET state = 'finished', attempts = COALESCE(?, attempts + 1), "
                 "started_at = ?, result = ?, pid = NULL, finished_at = ? "
                 "WHERE key = ? AND state != 'finished'")
_STATE = "SELECT state FROM requests WHERE key = ?"
_RESULT = "SELECT result FROM requests WHERE key = ?"
_UNFINISHED = ("SELECT key, request, attempts FROM requests WHERE state != 'finished' "
               "ORDER BY seq")
_ORPHANS = ("SELECT key, pid FROM requests WHERE state = 'running' AND pid IS NOT NULL "
            "ORDER BY seq")
_COUNTS = "SELECT state, count(*) FROM requests GROUP BY state"
_ROW = "SELECT request, state, result FROM requests WHERE key = ?"
_OLD_FINISHED = ("SELECT seq, request, result FROM requests WHERE state = 'finished' "
                 "AND finished_at < ? AND seq > ? ORDER BY seq LIMIT ?")
_SHRINK = "UPDATE requests SET request = ?, result = ? WHERE seq = ?"


class Journal:
    """The journal file at ``path`` (created with its parent directories if missing).

    Args:
        path: the SQLite file. SQLite also keeps ``<path>-wal`` and ``<path>-shm`` next
            to it while open, and the writer ``<path>.lock``; move or delete them
            together.
        fsync: durable against power loss too (``synchronous=FULL``), not only against
            a crash of the process (``synchronous=NORMAL``).
        lock: hold the journal exclusively while open (the default: a dispatcher's
            journal has one writer). ``False`` for a reader beside a live dispatcher (a
            reader does not create a missing journal).

    Raises:
        ConfigError: (a ValueError, field ``journal``) the file is not a journal this
            version can read (see the module docstring), or another process holds it
            (:class:`JournalLocked`), with what to do.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False,
                 lock: bool = True) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _bad(self.path, f"cannot make its directory ({e.strerror or e})") from None
        self._lock_fd = -1
        if lock:  # first: no other writer can be creating or changing the file now
            try:
                self._lock_fd = _lock(self.path)
            except OSError as e:
                raise _bad(self.path, f"cannot lock it ({e.strerror or e})") from None
        try:
            self._open(fsync)
        except BaseException:
            self._unlock()
            raise
        self._x = self._db.execute  # bound once: saves an attribute lookup per call

    def _open(self, fsync: bool) -> None:
        path = self.path
        try:
            if path.exists():
                if path.is_dir():
                    raise _bad(path, "is a directory; give a file path")
                problem = _header_problem(path)
                if problem is not None:
                    raise _bad(path, problem)
                for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                    _owner_only(p)
            elif self._lock_fd < 0:
                raise _bad(path, "no such journal (a reader does not create one)")
            else:
                _create(path)
        except OSError as e:
            raise _bad(path, f"cannot open it ({e.strerror or e})") from None
        # isolation_level=None: autocommit. A single INSERT/UPDATE is then its own
        # transaction, committed when execute() returns, without the implicit BEGIN and
        # the separate COMMIT call the default mode costs.
        self._db = sqlite3.connect(path, isolation_level=None)
        try:
            self._setup(fsync)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise _bad(path, f"unreadable ({e}); restore it from a copy, or move it aside "
                       f"to start a new journal") from None
        except BaseException:
            self._db.close()
            raise

    def _setup(self, fsync: bool) -> None:
        db = self._db
        try:
            # Waits up to 5 s for another connection's lock (a reader's checkpoint, a
            # second opener creating the schema) instead of failing at once.
            db.execute("PRAGMA busy_timeout = 5000")
            # The write lock while deciding: two processes opening a new file at once
            # must not both create the schema.
            db.execute("BEGIN IMMEDIATE")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = [r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")]
        except sqlite3.DatabaseError as e:
            raise _bad(self.path, f"not a journal ({e}); move it aside or choose another "
                       f"journal path") from None
        try:
            if version == 0 and not tables:  # a new (empty) file
                db.execute(_SCHEMA)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version == 0:
                raise _bad(self.path, f"an SQLite file that is not a metasched journal "
                           f"(tables {', '.join(tables[:5])}); choose another journal path")
            elif version != SCHEMA_VERSION:
                raise _bad(self.path, f"journal schema version {version}, but this "
                           f"metasched reads version {SCHEMA_VERSION}; finish its requests "
                           f"with the metasched that wrote it, or move the file (with its "
                           f"-wal and -shm files) aside to start a new journal")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        # WAL is a property of the file (it persists), but setting it is cheap and makes
        # a journal created by hand right too. It cannot change inside a transaction.
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":  # e.g. a file system without shared-memory support
            raise _bad(self.path, f"cannot use WAL mode (got {mode!r}); put the journal "
                       f"on a local file system")
        db.execute(f"PRAGMA synchronous = {'FULL' if fsync else 'NORMAL'}")

    # --- writes (each committed before it returns) ----------------------------------

    def accept(self, key: str, request: str) -> tuple[bool, int]:
        """Record a request as queued and commit it; acknowledge it only afterwards.

        Args:
            key: the request's idempotency key.
            request: its JSON text (stored as given, not parsed).

        Returns:
            ``(True, seq)`` for a new key; ``(False, seq)`` if the key was already
            accepted, leaving that row unchanged. ``seq`` is the acceptance order.
        """
        cur = self._x(_INSERT, (key, request, time.time()))
        if cur.rowcount == 1:
            return True, cur.lastrowid  # type: ignore[return-value]
        return False, self._x(_SEQ, (key,)).fetchone()[0]

    def accept_many(self, items: Iterable[tuple[str, str]]) -> list[tuple[bool, int]]:
        """:meth:`accept` for each ``(key, request)``, in one transaction (one commit:
        cheaper per request; all or none are recorded). A key repeated within ``items``
        is accepted once and reported ``(False, seq)`` the second time."""
        x, now = self._x, time.time()
        out: list[tuple[bool, int]] = []
        x("BEGIN IMMEDIATE")
        try:
            for key, request in items:
                cur = x(_INSERT, (key, request, now))
                if cur.rowcount == 1:
                    out.append((True, cur.lastrowid))  # type: ignore[arg-type]
                else:
                    out.append((False, x(_SEQ, (key,)).fetchone()[0]))
            x("COMMIT")
        except BaseException:
            x("ROLLBACK")
            raise
        return out

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run the writes made inside as one transaction (one commit for all: group
        commit). Nothing inside is durable until the block ends; on an exception none
        of it is recorded."""
        x = self._x
        x("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            x("ROLLBACK")
            raise
        x("COMMIT")

    def started(self, key: str, *, pid: int | None = None, attempt: int | None = None
                ) -> None:
        """Mark a request running: count an attempt, record when and (``pid``) the
        process group to kill if the dispatcher dies while it runs.

        Args:
            pid: process group id of the action's process, if it has one.
            attempt: the attempt number to record; default: one more than recorded.

        Raises:
            KeyError: no such request. ValueError: it is already finished.
        """
        if self._x(_START, (attempt, pid, time.time(), key)).rowcount != 1:
            self._missing_or_finished(key)

    def finished(self, key: str, result: str) -> None:
        """Mark a request finished (from queued or running) with its ``result`` JSON
        text, and forget its pid.

        Raises:
            KeyError: no such request. ValueError: it is already finished (its first
                result stands).
        """
        if self._x(_FINISH, (result, time.time(), key)).rowcount != 1:
            self._missing_or_finished(key)

    def record(self, started: Iterable[tuple[str, int | None, int | None, float]],
               finished: Iterable[tuple[str, str, float]],
               started_finished: Iterable[tuple[str, int | None, float, str, float]] = (),
               ) -> int:
        """Many :meth:`started` and :meth:`finished` writes at once, one prepared
        statement run over each list (``executemany``: far less per row than a call
        each). Call inside :meth:`batch` to commit them together.

        Args:
            started: ``(key, pid, attempt, started_at)`` rows, as :meth:`started`.
            finished: ``(key, result, finished_at)`` rows, as :meth:`finished`.
            started_finished: ``(key, attempt, started_at, result, finished_at)`` rows
                for requests that started and finished before their start was written:
                one update records both (the start's pid is moot once finished).

        Returns:
            How many rows named no unfinished request and were skipped (unlike the
            single-row calls, which raise): a caller that never writes for an unknown
            or finished request gets 0.
        """
        x = self._db.executemany
        rows = 0
        started = [(attempt, pid, at, key) for key, pid, attempt, at in started]
        finished = [(result, at, key) for key, result, at in finished]
        both = [(attempt, t0, result, t1, key)
                for key, attempt, t0, result, t1 in started_finished]
        for sql, params in ((_START, started), (_FINISH, finished), (_START_FINISH, both)):
            if params:
                rows += x(sql, params).rowcount
        return len(started) + len(finished) + len(both) - rows

    def _missing_or_finished(self, key: str) -> None:
        if self.status(key) is None:
            raise KeyError(key)
        raise ValueError(f"request {key!r} is already finished")

    # --- reads ------------------------------------------------------------------------

    def result(self, key: str) -> str | None:
        """The result JSON text of a finished request; None otherwise or if unknown."""
        row = self._x(_RESULT, (key,)).fetchone()
        return None if row is None else row[0]

    def status(self, key: str) -> str | None:
        """``'queued'``, ``'running'``, ``'finished'``, or None for an unknown key."""
        row = self._x(_STATE, (key,)).fetchone()
        return None if row is None else row[0]

    def unfinished(self) -> list[tuple[str, str, int]]:
        """``(key, request, attempts)`` of every queued or running request, in
        acceptance order: what to run again after a restart. Scans the table (meant for
        startup, not for every action)."""
        return self._x(_UNFINISHED).fetchall()

    def orphans(self) -> list[tuple[str, int]]:
        """``(key, pid)`` of running requests with a recorded process group: after a
        crash, those groups may still be alive and should be killed before re-running."""
        return self._x(_ORPHANS).fetchall()

    def row(self, key: str) -> tuple[str, str, str | None] | None:
        """``(request, state, result)`` texts of ``key``'s row (result None until it
        finished), or None for an unknown key."""
        return self._x(_ROW, (key,)).fetchone()

    def counts(self) -> dict[str, int]:
        """Requests per state (every state present, zeros included). Scans the table."""
        out = dict.fromkeys(STATES, 0)
        out.update(self._x(_COUNTS).fetchall())
        return out

    # --- upkeep -------------------------------------------------------------------------

    def compact(self, older_than_s: float, shrink: Callable[[str, str], tuple[str, str]],
                *, vacuum: bool = False, batch: int = 1000) -> int:
        """Replace the texts of rows finished more than ``older_than_s`` seconds ago by
        what ``shrink(request, result)`` returns (e.g. without the command's output),
        keeping every row and so every id (a resubmitted id is still known). Space freed
        inside the file is reused by later rows; ``vacuum`` also returns it to the file
        system (rewrites the whole file: slow on a large journal).

        Returns:
            How many rows were rewritten (a row whose texts ``shrink`` leaves unchanged,
            e.g. one compacted before, is not counted).
        """
        if not older_than_s >= 0:  # also rejects NaN
            raise ValueError(f"older_than_s: must be >= 0 (got {older_than_s!r})")
        before = time.time() - older_than_s
        x, seq, n = self._x, 0, 0
        while True:
            rows = x(_OLD_FINISHED, (before, seq, batch)).fetchall()
            if not rows:
                break
            changed = []
            for seq, request, result in rows:
                new = shrink(request, result)
                if new != (request, result):
                    changed.append((*new, seq))
            with self.batch():  # one commit per batch: a long compaction stays interruptible
                self._db.executemany(_SHRINK, changed)
            n += len(changed)
        if vacuum:
            x("VACUUM")
        return n

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file and release the lock (idempotent). Nothing is lost by not
        calling it: every write was committed when it returned."""
        self._db.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Journal", "JournalLocked", "SCHEMA_VERSION", "STATES"]
