"""A JSONL job file, read as a stream: one request per line, never the whole file at once.

Each line is parsed and checked on its own (``metasched.runtime.requests``); a line that
cannot be a request becomes a ``rejected`` :class:`Result` naming the file, the line and
the field, and the lines after it are read as usual. Blank lines and lines starting with
``#`` are skipped. A line without an ``id`` gets ``line-<n>``, so the same file run again
on the same journal resumes it.

Rejected alone:

- invalid JSON, or JSON that is not a request;
- bytes that are not UTF-8 (named by line and column);
- an ``id`` an earlier line of the file already has (the first one stands);
- a line longer than :data:`MAX_LINE_BYTES`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from metasched.errors import ConfigError
from metasched.runtime.requests import REJECTED, Request, Result, parse_request

MAX_LINE_BYTES = 16 * 1024 * 1024


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """``(number, line)`` of every line, ``None`` for one over the limit (skipped to its
    end without holding it)."""
    n = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield n, None
            continue
        yield n, line


def _open(path: str | Path) -> BinaryIO:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the callers' with blocks
    except OSError as e:
        raise ConfigError("jobs", f"cannot read {path} ({e.strerror or e})") from None
    if not Path(path).is_file():
        f.close()
        raise ConfigError("jobs", f"cannot read {path} (not a file)")
    return f


def count_requests(path: str | Path) -> int:
    """How many lines of the job file are not blank or comments (a quick pass: what a
    progress bar needs). Raises ConfigError if it cannot be read or holds none."""
    n = 0
    with _open(path) as f:
        for _, line in _lines(f):
            stripped = b"" if line is None else line.strip()
            n += line is None or (bool(stripped) and not stripped.startswith(b"#"))
    if not n:
        raise ConfigError("jobs", f"{path} holds no requests")
    return n


def read_jobs(path: str | Path) -> Iterator[tuple[int, Request | Result]]:
    """The job file's requests in order, as ``(line number, request)``: a parsed
    :class:`Request` (with its ``id``), or a ``rejected`` :class:`Result` for a line that
    cannot be one. Reads a line at a time; remembers the ids given in the file and one
    bit per line that got ``line-<n>`` (a 100,000-line file without ids: 12.5 kB)."""
    name = Path(path).name
    seen = _Ids()
    with _open(path) as f:
        for n, raw in _lines(f):
            loc = f"{name}:{n}"
            if raw is None:
                yield n, _rejected(n, f"{loc}: longer than {MAX_LINE_BYTES >> 20} MiB")
                continue
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                yield n, _rejected(n, f"{loc}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                      f"column {e.start + 1})")
                continue
            if not line or line.startswith("#"):
                continue
            yield n, _request(line, n, loc, seen)


class _Ids:
    """The ids the lines read so far have: those given (id -> line), and the lines that
    got ``line-<n>`` (a bit each: such an id is unique unless a line gave it too)."""

    def __init__(self) -> None:
        self.given: dict[str, int] = {}
        self.auto = bytearray()

    def first(self, rid: str, n: int, auto: bool) -> int:
        """The earliest line with ``rid`` (``n`` if none before it), recording line
        ``n`` as having it."""
        if auto:
            if len(self.auto) <= n >> 3:
                self.auto.extend(bytes(max(64, len(self.auto))))
            self.auto[n >> 3] |= 1 << (n & 7)
            return self.given.get(rid, n)
        first = self.given.setdefault(rid, n)
        m = _auto_line(rid)
        if m is not None and m < n and m >> 3 < len(self.auto) and \
                self.auto[m >> 3] >> (m & 7) & 1:
            first = min(first, m)  # line m got this id as its line-<m>
        return first


def _auto_line(rid: str) -> int | None:
    """``m`` if ``rid`` is ``line-<m>``, the id line m gets when it gives none."""
    if rid.startswith("line-") and rid[5:].isdigit() and rid[5:] == str(int(rid[5:])):
        return int(rid[5:])
    return None


def _request(line: str, n: int, loc: str, seen: _Ids) -> Request | Result:
    try:
        d: Any = json.loads(line)
    except (ValueError, RecursionError) as e:
        return _rejected(n, f"{loc}: invalid JSON ({getattr(e, 'msg', type(e).__name__)})")
    auto = isinstance(d, dict) and "id" not in d
    if auto:
        d["id"] = f"line-{n}"
    try:
        req = parse_request(d, loc)
    except ConfigError as e:
        rid = d.get("id") if isinstance(d, dict) else None
        return Result(str(rid or f"line-{n}"), REJECTED, str(e))
    first = seen.first(req.id, n, auto)
    if first != n:
        return Result(req.id, REJECTED, f"{loc}: id: {req.id!r} is already the id of line "
                      f"{first} (give each line its own id)")
    return req


def _rejected(n: int, reason: str) -> Result:
    return Result(f"line-{n}", REJECTED, reason)


__all__ = ["MAX_LINE_BYTES", "count_requests", "read_jobs"]
