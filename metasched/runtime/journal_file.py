"""The journal's file (:mod:`metasched.runtime.journal`): its schema, a new one made
owner-only and renamed into place, the checks of an existing one's size and header,
and the writer's exclusive lock beside it."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import stat
from pathlib import Path

from metasched.errors import ConfigError

__all__ = ["SCHEMA_VERSION", "STATES", "JournalLocked"]

SCHEMA_VERSION = 1
STATES = ("queued", "running", "finished")

_SCHEMA = """
CREATE TABLE requests (
    seq         INTEGER PRIMARY KEY,  -- rowid: acceptance order
    key         TEXT NOT NULL UNIQUE,
    request     TEXT NOT NULL,        -- JSON text, stored as given
    state       TEXT NOT NULL CHECK (state IN ('queued', 'running', 'finished')),
    attempts    INTEGER NOT NULL DEFAULT 0,
    pid         INTEGER,              -- process group of the running attempt
    accepted_at REAL NOT NULL,        -- Unix time
    started_at  REAL,
    finished_at REAL,
    result      TEXT                  -- JSON text, stored as given
);
"""

_MODE = 0o600  # the journal's files: owner only
_HEADER = b"SQLite format 3\x00"


def _bad(path: Path, problem: str) -> ConfigError:
    return ConfigError("journal", f"{path}: {problem}")


def _header_problem(path: Path) -> str | None:
    """Why the file at ``path`` cannot be a journal, judged from its size and header
    alone (None: it may be one)."""
    size = path.stat().st_size
    if size == 0:
        wal = Path(f"{path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return None  # everything is still in the WAL: SQLite reads it from there
        return ("empty (0 bytes): not a journal (a journal is never empty: was it "
                "truncated?); delete it or move it aside to start a new journal")
    with open(path, "rb") as f:
        head = f.read(100)
    if not head.startswith(_HEADER):
        return ("not an SQLite file, so not a journal; move it aside or choose another "
                "journal path")
    if len(head) == 100:
        page = int.from_bytes(head[16:18], "big")
        page = 65536 if page == 1 else page
        pages = int.from_bytes(head[28:32], "big")
        # The page count is trusted only while its "valid for" counter matches the
        # change counter (SQLite's own rule).
        if head[24:28] == head[92:96] and pages and size < pages * page:
            return (f"truncated ({size} bytes; its header says {pages * page}); restore it "
                    f"from a copy, or move it aside to start a new journal")
    return None


def _owner_only(path: Path) -> None:
    """Make ``path`` (if it exists and is ours) readable by its owner only."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)


def _create(path: Path) -> None:
    """A new, empty journal at ``path``, made under another name and renamed into place,
    so that no one ever sees a half-made (0-byte) journal there. Made 0600: SQLite gives
    the ``-wal`` and ``-shm`` files the same mode."""
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}")
    try:
        os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _MODE))
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute(_SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("PRAGMA journal_mode = WAL")  # kept in the file's header
        finally:
            db.close()  # the last connection: SQLite removes the -wal and -shm files
        os.rename(tmp, path)
    except BaseException:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            p.unlink(missing_ok=True)
        raise


class JournalLocked(ConfigError):
    """Another process holds the journal (its pid in :attr:`holder`, 0 if unknown)."""

    def __init__(self, path: Path, holder: int) -> None:
        who = f"pid {holder}" if holder else "another process"
        super().__init__("journal", f"{path} is in use by another dispatcher ({who}); stop "
                         f"it first, or choose another journal")
        self.holder = holder


def _lock(path: Path) -> int:
    """Take the exclusive lock on ``<path>.lock`` (made 0600) and write this process's
    pid into it; returns the lock's descriptor (not inherited by children)."""
    lock = Path(f"{path}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise JournalLocked(path, int(text) if text.isdigit() else 0) from None
        _owner_only(lock)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd

