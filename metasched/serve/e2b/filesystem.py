"""envd's filesystem: the Connect RPC ``filesystem.Filesystem`` service (``Stat``,
``ListDir``, ``MakeDir``, ``Move``, ``Remove``) and the plain HTTP file transfer
(``GET /files``: download, ``POST /files``: upload, ``application/octet-stream`` or
``multipart/form-data``, written as it comes in: see :mod:`.uploads`), each operation
one action of the sandbox running :func:`.programs.fs_argv` in its workspace (the
paths confined to it).

A download reads the file in pieces that fit the output an action's result keeps
(the dispatcher's ``tail_bytes``): a file of n bytes takes about n / (0.75 tail_bytes)
actions. Watching directories (``WatchDir``, watchers) is not offered.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from metasched.serve.e2b import programs
from metasched.serve.e2b.envd import filesystem_pb as pb
from metasched.serve.e2b.lifecycle import e2b_error
from metasched.serve.e2b.sandboxes import Sandbox, Sandboxes
from metasched.serve.e2b.uploads import UploadRefused, receive_upload
from metasched.serve.e2b.users import user_refusal

__all__ = ["FilesystemService", "files_router", "run_fs"]

log = logging.getLogger("metasched.serve")

_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY,
          "symlink": pb.FileType.SYMLINK}
_CODES = {"not_found": (Code.NOT_FOUND, 404), "exists": (Code.ALREADY_EXISTS, 409),
          "denied": (Code.PERMISSION_DENIED, 403), "invalid": (Code.INVALID_ARGUMENT, 400),
          "too_large": (Code.RESOURCE_EXHAUSTED, 413)}


class FsError(Exception):
    """A filesystem operation that failed: its kind (``not_found`` ...) and one line."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message

    def connect(self) -> ConnectError:
        return ConnectError(_CODES.get(self.kind, (Code.INTERNAL, 500))[0], self.message)

    def http(self) -> JSONResponse:
        return e2b_error(_CODES.get(self.kind, (Code.INTERNAL, 500))[1], self.message)


async def run_fs(sb: Sandbox, op: dict[str, Any], pieces: list[str] | None = None,
                 argv: list[str] | None = None) -> Any:
    """Run one filesystem operation in ``sb``; what it answered.

    Raises:
        FsError: it failed (a path refused or not found, the action failed ...).
    """
    limit = _output_bytes(sb)
    if argv is None:
        op = {**op, "limit": limit - 64, "spill": uuid.uuid4().hex}
        argv = programs.fs_argv(op, pieces or [])
    r = await sb.run(argv, f"fs:{op['op']}")
    try:
        doc = json.loads(r.stdout) if r.ok else None
    except ValueError:
        doc = None
    if doc is None:
        last = (r.stderr.strip().splitlines() or [""])[-1][-300:]
        raise FsError("internal", f"{op['op']}: {r.reason or 'no answer'}"
                      + (f": {last}" if last else ""))
    if "spilled" in doc:  # more than one result holds: read back in pieces, then removed
        spilled = doc["spilled"]
        try:
            doc = json.loads(await read_file(sb, spilled))
        finally:
            await run_fs(sb, {"op": "remove", "path": spilled})
    if "error" in doc:
        raise FsError(*doc["error"])
    return doc["ok"]


async def read_file(sb: Sandbox, path: str) -> bytes:
    """The content of file ``path`` of ``sb`` (a small one: a spilled answer), read in
    pieces that each fit an action's result.

    Raises:
        FsError: it could not be read.
    """
    return b"".join([piece async for piece in read_pieces(sb, path)])


async def read_pieces(sb: Sandbox, path: str, max_bytes: int | None = None
                      ) -> AsyncIterator[bytes]:
    """The content of file ``path`` of ``sb``, piece by piece as each action reads it
    (one piece in memory at a time).

    Raises:
        FsError: it could not be read, or (``too_large``, before any piece) it holds
            more than ``max_bytes``.
    """
    chunk = max(1, (_output_bytes(sb) - 256) // 4 * 3)
    offset, size = 0, None
    while size is None or offset < size:
        out = await run_fs(sb, {"op": "read", "path": path, "offset": offset,
                                "length": chunk})
        if size is None and max_bytes is not None and out["size"] > max_bytes:
            raise FsError("too_large", f"path: {path!r} holds {out['size']} bytes, more "
                          f"than a download may ({max_bytes}: max_file_mb)")
        data = base64.b64decode(out["data"])
        offset += len(data)
        size = out["size"] if data else offset
        if data:
            yield data


def _output_bytes(sb: Sandbox) -> int:
    """How much of an action's output its result keeps (the dispatcher's
    ``tail_bytes``)."""
    config = getattr(sb.service.dispatcher, "config", None)
    return int(getattr(config, "tail_bytes", 4096))


def _entry(e: dict[str, Any]) -> pb.EntryInfo:
    t = float(e["mtime"])
    return pb.EntryInfo(
        name=e["name"], type=_TYPES.get(e["type"], pb.FileType.FILE), path=e["path"],
        size=int(e["size"]), mode=int(e["mode"]), permissions=e["permissions"],
        owner=e["owner"], group=e["group"], symlink_target=e.get("symlink"),
        is_symlink=bool(e.get("is_symlink")),
        modified_time=Timestamp(seconds=int(t), nanos=int(t % 1 * 1e9)))


class FilesystemService:
    """The ``filesystem.Filesystem`` service over ``sandboxes``."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    async def _run(self, ctx: Any, op: dict[str, Any]) -> Any:
        from metasched.serve.e2b.process import sandbox_of

        sb = sandbox_of(self.sandboxes, ctx)
        try:
            return await run_fs(sb, op)
        except FsError as e:
            raise e.connect() from None

    async def stat(self, request: pb.StatRequest, ctx: Any) -> pb.StatResponse:
        return pb.StatResponse(entry=_entry(await self._run(ctx, {"op": "stat",
                                                                  "path": request.path})))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: Any) -> pb.MakeDirResponse:
        out = await self._run(ctx, {"op": "mkdir", "path": request.path})
        if out["exists"]:
            raise ConnectError(Code.ALREADY_EXISTS, f"path: {request.path!r} already exists")
        return pb.MakeDirResponse(entry=_entry(out["entry"]))

    async def move(self, request: pb.MoveRequest, ctx: Any) -> pb.MoveResponse:
        out = await self._run(ctx, {"op": "move", "path": request.source,
                                    "to": request.destination})
        return pb.MoveResponse(entry=_entry(out))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Any) -> pb.ListDirResponse:
        out = await self._run(ctx, {"op": "list", "path": request.path,
                                    "depth": max(1, request.depth)})
        return pb.ListDirResponse(entries=[_entry(e) for e in out])

    async def remove(self, request: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        await self._run(ctx, {"op": "remove", "path": request.path})
        return pb.RemoveResponse()

    def watch_dir(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "watching directories is not offered here")

    async def create_watcher(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "watching directories is not offered here")

    async def get_watcher_events(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "watching directories is not offered here")

    async def remove_watcher(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "watching directories is not offered here")


def files_router(sandboxes: Sandboxes) -> APIRouter:
    """``GET /files`` and ``POST /files`` (envd's download and upload), under ``/e2b``."""
    router = APIRouter(include_in_schema=False)

    def find(request: Request) -> Sandbox:
        sid = request.headers.get("e2b-sandbox-id", "")
        sb = sandboxes.by_token(sid, request.headers.get("x-access-token"))
        if sb is None:
            raise FsError("not_found", f"sandbox {sid!r} not found (killed, timed out, "
                          f"or another access token's)")
        why = user_refusal(request.query_params.get("username"))
        if why is not None:
            raise FsError("denied", why)
        return sb

    @router.get("/files")
    async def download(request: Request) -> Response:
        """Streamed as it is read: the service holds one piece at a time. An error
        before the first piece is answered with its status; one after it (the file
        changed) cuts the response short."""
        try:
            pieces = read_pieces(find(request), request.query_params.get("path", ""),
                                 sandboxes.service.config.max_file_bytes)
            first = await anext(pieces, b"")
        except FsError as e:
            return e.http()

        async def rest() -> AsyncIterator[bytes]:
            try:
                yield first
                async for piece in pieces:
                    yield piece
            except FsError as e:  # the client sees the response cut short
                log.warning("e2b download cut short: %s", e.message)
                raise
            finally:
                await pieces.aclose()

        return StreamingResponse(rest(), media_type="application/octet-stream")

    @router.post("/files")
    async def upload(request: Request) -> Response:
        """Written as it comes in, each file under its name once the body is whole
        (see :mod:`.uploads`); a body refused on the way leaves none of its files."""
        try:
            sb = find(request)
        except FsError as e:
            return await _refuse_unread(request, e.http())
        try:
            return JSONResponse(await receive_upload(
                request, sb, run_fs, sandboxes.service.config.max_file_bytes))
        except FsError as e:
            return e.http()
        except UploadRefused as e:
            answer = e2b_error(e.status, e.message)
            answer.headers["connection"] = "close"  # the rest of its body is not read
            return answer

    @router.get("/health")
    async def health(request: Request) -> Response:
        # 502 is what the SDK reads as "not running" (is_running() False): a sandbox
        # killed, past its timeout, unknown, or another access token's.
        sb = sandboxes.by_token(request.headers.get("e2b-sandbox-id", ""),
                                request.headers.get("x-access-token"))
        if sb is None:
            return e2b_error(502, "sandbox not running (killed, timed out or unknown)")
        return Response(status_code=204)

    return router


# A refused body up to this size is read and dropped before the answer: closing a socket
# with unread bytes in it resets the connection, and the client may then see the reset
# instead of the answer. A larger body is not read: its answer closes the connection.
DRAIN_BYTES = 1 << 20


async def _refuse_unread(request: Request, answer: Response) -> Response:
    """``answer`` to an upload refused before its body was read (the client still sees
    it, whatever the body's size)."""
    read = 0
    async for piece in request.stream():
        read += len(piece)
        if read > DRAIN_BYTES:
            answer.headers["connection"] = "close"
            break
    return answer
