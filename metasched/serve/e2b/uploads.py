"""E2B uploads (``POST /e2b/files``), written to the sandbox as the body comes in.

The body (``application/octet-stream`` with ``?path=``, or ``multipart/form-data``
with one part per file, read by python-multipart's streaming parser) is never held
whole: each file's bytes gather up to :data:`PIECE_BYTES`, and a file past that is
appended to a temporary file in the sandbox's control directory (``.e2b/up-<id>``), one
writing action per piece, while the next piece is read. Once the whole body is in, one
``commit`` action per batch moves each file under its name (files small enough to be
held go in that action's arguments). A body refused on the way (over ``max_file_mb``,
no data for ``body_timeout_s``, malformed, the client gone) leaves no file under any
name it gave: its temporary files are removed, and a crash can leave them only in the
control directory, which listings skip.

Where the service holds memory for one upload: at most two pieces (the one being read,
and the one being written, as base64 in an action's arguments).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from metasched.serve.e2b.programs import CONTROL
from metasched.serve.e2b.sandboxes import Sandbox
from metasched.serve.files import PER_COMMAND, PIECE
from metasched.serve.security import BodyRefused

__all__ = ["PIECE_BYTES", "UploadRefused", "receive_upload"]

log = logging.getLogger("metasched.serve")

# run_fs(sandbox, op, base64 pieces): the operation's answer (raises FsError).
RunFs = Callable[[Sandbox, dict[str, Any], list[str]], Awaitable[Any]]
# Bytes per writing action: their base64 and the program within what one command may
# carry (its argv and environment: 1 MiB, the sandbox server's MAX_MESSAGE).
ARGV_CHARS = PER_COMMAND - 64 * 1024
PIECE_BYTES = ARGV_CHARS // 4 * 3
COMMIT_OP_CHARS = 64 * 1024  # of one commit's file list (one argument: at most 128 KiB)


class UploadRefused(Exception):
    """An upload not written: the HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _File:
    """One file of an upload: its name (None: not known yet), what is held of it, and
    its temporary file once it outgrew that."""

    name: str | None
    held: bytearray = field(default_factory=bytearray)
    temp: str | None = None
    size: int = 0


class _Upload:
    """The files of one upload as they come (see the module docstring)."""

    def __init__(self, sb: Sandbox, run: RunFs) -> None:
        self.sb, self.run = sb, run
        self.files: list[_File] = []
        self.held = 0  # bytes held over all files

    async def add(self, data: bytes) -> None:
        """Append ``data`` to the last file, writing a piece out when enough is held."""
        f = self.files[-1]
        f.held += data
        f.size += len(data)
        self.held += len(data)
        while f.held and (len(f.held) >= PIECE_BYTES if f.temp is not None
                          else self.held > PIECE_BYTES):
            await self._spill(f, min(len(f.held), PIECE_BYTES))

    async def _spill(self, f: _File, n: int) -> None:
        first = f.temp is None
        if first:
            f.temp = f"{CONTROL}/up-{uuid.uuid4().hex}"
        text = _b64(bytes(f.held[:n]))
        del f.held[:n]
        self.held -= n
        await self.run(self.sb, {"op": "write", "path": f.temp, "append": not first},
                     [text[i:i + PIECE] for i in range(0, len(text), PIECE)])

    async def commit(self) -> list[dict[str, Any]]:
        """Every file under its name: its rest written out, then renamed into place
        (held ones written there), in as few actions as the arguments allow."""
        for f in self.files:
            while f.temp is not None and f.held:
                await self._spill(f, min(len(f.held), PIECE_BYTES))
        written: list[dict[str, Any]] = []
        batch: list[tuple[_File, dict[str, Any]]] = []
        pieces: list[str] = []
        chars = 0
        for f in self.files:
            text = _b64(bytes(f.held)) if f.temp is None else ""
            f.held.clear()
            entry: dict[str, Any] = {"path": f.name}
            if f.temp is not None:
                entry["from"] = f.temp
            else:
                entry["pieces"] = len(range(0, len(text), PIECE)) or 1
            size = len(str(entry)) + 16
            if batch and (chars + size > COMMIT_OP_CHARS or
                          chars + size + sum(map(len, pieces)) + len(text) > ARGV_CHARS):
                written += await self._commit(batch, pieces)
                batch, pieces, chars = [], [], 0
            batch.append((f, entry))
            pieces += [text[i:i + PIECE] for i in range(0, len(text), PIECE)] or \
                ([""] if f.temp is None else [])
            chars += size
        if batch:
            written += await self._commit(batch, pieces)
        return written

    async def _commit(self, batch: list[tuple[_File, dict[str, Any]]],
                      pieces: list[str]) -> list[dict[str, Any]]:
        out = await self.run(self.sb, {"op": "commit", "files": [e for _, e in batch]}, pieces)
        for f, _ in batch:
            f.temp = None  # under its name now: nothing to remove
        return out

    def forget(self) -> None:
        """Remove what was written of a refused upload (in the background: its answer
        does not wait, and a client gone cancels no clean-up)."""
        temps = [f.temp for f in self.files if f.temp is not None]
        for f in self.files:
            f.temp = None

        async def remove() -> None:
            for temp in temps:
                try:
                    await self.run(self.sb, {"op": "remove", "path": temp}, [])
                except Exception as e:  # the sandbox ended: its workspace went with it
                    log.info("e2b upload: %s not removed: %s", temp, e)

        if temps:
            task = asyncio.ensure_future(remove())
            _CLEANING.add(task)
            task.add_done_callback(_CLEANING.discard)


_CLEANING: set[asyncio.Future[None]] = set()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


async def receive_upload(request: Request, sb: Sandbox, run: RunFs,
                         cap: int) -> list[dict[str, Any]]:
    """Write the files of ``request``'s body into ``sb`` as it comes in, each action
    by ``run`` (:func:`.filesystem.run_fs`); the entries of the files written (name,
    type, path), in the body's order. ``cap``: the most bytes a gzip body may hold
    once decompressed (the body itself is capped as it comes, by the service's gate).

    Raises:
        UploadRefused: the body was refused (its files are not written).
        FsError: an action failed (a path refused ...; nothing of the body is left
            but files committed before the failing one).
    """
    kind = request.headers.get("content-type", "")
    path = request.query_params.get("path")
    upload = _Upload(sb, run)
    done = False
    try:
        if kind.startswith("multipart/form-data"):
            await _multipart(request, upload, kind)
            for f in upload.files:
                if path and len(upload.files) == 1:
                    f.name = path
                if not f.name:
                    raise UploadRefused(400, "file: a part names no file (filename=...)")
        else:
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", "", "gzip"):
                raise UploadRefused(400, f"Content-Encoding: {encoding!r} is not accepted "
                                    f"(gzip or none)")
            if not path:
                raise UploadRefused(400, "path: required for an application/octet-stream "
                                    "upload")
            upload.files.append(_File(path))
            pieces = request.stream()
            if encoding == "gzip":
                pieces = _gunzipped(pieces, cap)
            async for chunk in pieces:
                await upload.add(chunk)
        written = await upload.commit()
        done = True
        return [{"name": e["name"], "type": "file", "path": e["path"]} for e in written]
    except BodyRefused as e:
        raise UploadRefused(e.status, f"upload: {e.detail}" + (
            " (max_file_mb)" if e.status == 413 else "")) from None
    except ClientDisconnect:
        raise UploadRefused(499, "upload: the client went before its body ended") from None
    finally:
        if not done:
            upload.forget()


async def _gunzipped(pieces: AsyncIterator[bytes], cap: int) -> AsyncIterator[bytes]:
    """The gzip body ``pieces`` decompressed, at most :data:`PIECE_BYTES` at a time,
    ``cap`` bytes in all (more: a 413, however small the body was).

    Raises:
        UploadRefused: not gzip, cut short, or more than ``cap`` bytes once decompressed.
    """
    unzip = zlib.decompressobj(16 + zlib.MAX_WBITS)
    total = 0
    try:
        async for piece in pieces:
            while piece:
                out = unzip.decompress(piece, PIECE_BYTES)
                piece = unzip.unconsumed_tail
                total += len(out)
                if total > cap:
                    raise UploadRefused(413, f"upload: more than {cap} bytes once "
                                        f"decompressed (max_file_mb)")
                yield out
    except zlib.error as e:
        raise UploadRefused(400, f"body: not gzip ({e})") from None
    if not unzip.eof:
        raise UploadRefused(400, "body: the gzip stream ended before its end")


async def _multipart(request: Request, upload: _Upload, kind: str) -> None:
    """Feed a multipart body through python-multipart's parser, each part a file of
    ``upload``.

    Raises:
        UploadRefused: no boundary, or a body that is not multipart.
    """
    _, options = parse_options_header(kind)
    boundary = options.get(b"boundary")
    if not boundary:
        raise UploadRefused(400, "Content-Type: multipart/form-data without a boundary")
    events: list[tuple[str, Any]] = []
    header: list[bytes] = [b"", b""]

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        if header[0].lower() == b"content-disposition":
            events.append(("name", parse_options_header(header[1])[1].get(b"filename")))
        header[:] = [b"", b""]

    callbacks: Any = {
        "on_part_begin": lambda: events.append(("part", None)),
        "on_part_data": lambda data, start, end: events.append(("data", data[start:end])),
        "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_end": lambda: events.append(("end", None))}
    parser = MultipartParser(boundary, callbacks)
    ended = False
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for what, value in events:
                if what == "part":
                    upload.files.append(_File(None))
                elif what == "name" and upload.files:
                    upload.files[-1].name = value.decode("utf-8", "replace") if value else None
                elif what == "data" and upload.files:
                    await upload.add(value)
                elif what == "end":
                    ended = True
            events.clear()
    except FormParserError as e:
        raise UploadRefused(400, f"body: not multipart/form-data ({e})") from None
    if not ended:
        raise UploadRefused(400, "body: the multipart body ended before its last boundary")
