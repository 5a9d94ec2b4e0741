"""``/run_code``'s files in and out of the trajectory's workspace, as ordinary commands.

The service does not reach into a sandbox: what a request brings (its code, its
``files``, its ``stdin``) is written by a small Python program run as one more ``cpu``
action of the request's trajectory, in its workspace, as the sandbox's user; what it
fetches (``fetch_files``) is read back by another, which prints the files as one JSON
object, those that fit one command's output whole, the larger ones by size, each then
read in pieces by one more command per piece as the answer streams
(:class:`FetchStream`). So files go wherever the dispatcher's commands go, whichever
dispatcher (or backend) the service fronts, with the sandbox's own limits and
permissions (what a fetch may read is what the sandbox's user may, as the sandbox sees
it: reading the workspace from the host instead would follow links out of it).

A command line holds at most ``ARG_MAX`` bytes (2 MiB on Linux, environment included)
and one argument at most 128 KiB, so the base64 text travels in pieces of
:data:`PIECE` characters, at most :data:`PER_COMMAND` characters per writing command
(larger inputs take several, in order, appending).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json
from starlette.responses import StreamingResponse

__all__ = ["PER_COMMAND", "PIECE", "FetchStream", "Fetched", "decoded_size", "fetch_argv",
           "kept_output", "parse_fetched", "piece_bytes", "read_argv", "stdin_argv",
           "stream_large", "write_argvs"]

log = logging.getLogger("metasched.serve")

PIECE = 96 * 1024  # base64 characters per argument (a multiple of 4: each decodes alone)
PER_COMMAND = 1024 * 1024  # base64 characters per writing command

# argv[1:] is (path, mode, base64) triples; parents are made as needed.
_WRITE = """import base64, os, sys
a = sys.argv[1:]
for i in range(0, len(a), 3):
    path, mode, data = a[i:i + 3]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, mode + "b") as f:
        f.write(base64.b64decode(data))
"""
# argv[1]: the characters its answer may take (what the dispatcher keeps of a command's
# output), argv[2]: the bytes all files may hold together (the cap), argv[3:]: paths.
# Each regular file it can read goes in "files" (base64) while the answer stays within
# argv[1], or in "large" (its size: read in pieces later) if it is larger; the rest in
# "errors" with one line saying why (a missing file is left out of "files", as
# SandboxFusion does; so is one past the cap).
_FETCH = """import base64, json, os, stat, sys
limit, cap = int(sys.argv[1]), int(sys.argv[2])
files, errors, large, total, room = {}, {}, {}, 0, limit - 4096
for path in sys.argv[3:]:
    try:
        if not os.path.exists(path):
            errors[path] = "not found"
            continue
        if not os.path.isfile(path):
            errors[path] = "not a regular file"
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # swapped for a FIFO: no wait
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                errors[path] = "not a regular file"
                continue
            head = f.read(max(room, 0) + 1)
            size = len(head)
            if size > room:  # larger than the answer holds: its size
                size = max(size, st.st_size)
                if size == len(head):  # it says less than it holds (/proc's say 0)
                    while size <= cap and (more := f.read(1 << 20)):
                        size += len(more)
        if total + size > cap:
            errors[path] = ("holds %d bytes: more than fetch_files may bring back in one "
                            "answer (%d bytes, max_file_mb)" % (size, cap))
            continue
        total += size
        text = base64.b64encode(head).decode() if size <= room else None
        if text is not None and len(text) + 6 * len(path) + 16 <= room:
            files[path] = text
            room -= len(text) + 6 * len(path) + 16
        else:
            large[path] = size
    except (OSError, ValueError, MemoryError) as e:
        errors[path] = getattr(e, "strerror", None) or type(e).__name__
out = json.dumps({"files": files, "errors": errors, "large": large})
while len(out) > limit and files:  # many errors: files read in pieces instead
    path, text = files.popitem()
    large[path] = len(base64.b64decode(text))
    out = json.dumps({"files": files, "errors": errors, "large": large})
print(out)
"""
# argv[1]: a path, argv[2]: an offset, argv[3]: a length; prints that piece's base64.
_READ = """import base64, os, stat, sys
path, offset, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
if not stat.S_ISREG(os.fstat(fd).st_mode):
    sys.exit(path + ": no longer a regular file")
os.lseek(fd, offset, os.SEEK_SET)
data = b""
while len(data) < length and (more := os.read(fd, length - len(data))):
    data += more
sys.stdout.write(base64.b64encode(data).decode())
"""


def decoded_size(text: str) -> int:
    """Bytes of the base64 ``text`` once decoded.

    Raises:
        ValueError: ``text`` is not base64.
    """
    try:
        return len(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        raise ValueError("must be base64") from None


def write_argvs(files: Mapping[str, str], python: str = "python3") -> Iterator[list[str]]:
    """The commands that write ``files`` (path -> base64 content) into the working
    directory, in order: one for small inputs, more past :data:`PER_COMMAND`."""
    argv: list[str] = [python, "-c", _WRITE]
    size = 0
    for path, text in files.items():
        pieces = [text[i:i + PIECE] for i in range(0, len(text), PIECE)] or [""]
        for n, piece in enumerate(pieces):
            if size and size + len(piece) > PER_COMMAND:
                yield argv
                argv, size = [python, "-c", _WRITE], 0
            argv += [path, "w" if n == 0 else "a", piece]
            size += len(piece) + len(path)
    if len(argv) > 3:
        yield argv


def stdin_argv(path: str, argv: list[str]) -> list[str]:
    """``argv`` run with its standard input read from the file ``path``."""
    return ["/bin/sh", "-c", 'exec "$@" < "$0"', path, *argv]


def fetch_argv(paths: list[str], python: str = "python3", *, answer_chars: int,
               cap: int) -> list[str]:
    """The command that prints ``paths`` as one JSON object of at most
    ``answer_chars`` characters: ``files`` (path -> base64 of each one it could read
    that fits), ``large`` (path -> size of each larger one: see :class:`FetchStream`)
    and ``errors`` (path -> why not, for the others, and for each one past ``cap``
    bytes of files in all)."""
    return [python, "-c", _FETCH, str(answer_chars), str(cap), *paths]


def read_argv(path: str, offset: int, length: int, python: str = "python3") -> list[str]:
    """The command that prints the base64 of ``length`` bytes of file ``path`` from
    ``offset`` (fewer at its end)."""
    return [python, "-c", _READ, path, str(offset), str(length)]


@dataclass
class Fetched:
    """What the fetching command found: files read whole (path -> base64), larger
    ones (path -> size) and, for each path that could not be read, why."""

    files: dict[str, str]
    large: dict[str, int]
    errors: dict[str, str]


def parse_fetched(stdout: str) -> Fetched:
    """What the fetching command printed.

    Raises:
        ValueError: it is not the whole object.
    """
    try:
        doc = json.loads(stdout)
    except ValueError:
        raise ValueError(f"the fetching command's answer was cut at {len(stdout)} bytes "
                         f"(the dispatcher's tail_bytes)") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), dict)
                                            for k in ("files", "errors", "large")):
        raise ValueError("the fetching command printed no JSON object of files and errors")
    return Fetched({str(k): str(v) for k, v in doc["files"].items()},
                   {str(k): int(v) for k, v in doc["large"].items()},
                   {str(k): str(v) for k, v in doc["errors"].items()})


def kept_output(dispatcher: object) -> int:
    """How much of a command's output its result keeps (the dispatcher's
    ``tail_bytes``; 4096 where it says none)."""
    return int(getattr(getattr(dispatcher, "config", None), "tail_bytes", 4096))


def piece_bytes(kept: int) -> int:
    """Bytes of a file one reading command brings back when ``kept`` bytes of its
    output are kept: their base64 (and a margin) fits, a multiple of 3."""
    return max(3, (kept - 256) // 4 * 3)


def stream_large(fetched: Fetched, order: list[str], streams: list[FetchStream] | None,
                 run: Callable[[list[str]], Awaitable[Any]], kept: int,
                 close: Callable[[], None], python: str = "python3") -> bool:
    """Whether the answer streams: the files of ``fetched`` too large for one command's
    output (``kept`` bytes) become a :class:`FetchStream` in ``streams``, each piece
    read by ``run`` (an action of the request's trajectory: its result), ``close``
    called once the answer is written. With ``streams`` None (no HTTP answer to write
    them to), they are named in ``fetched.errors`` instead."""
    if not fetched.large:
        return False
    if streams is None:
        fetched.errors.update(dict.fromkeys(fetched.large, "larger than one command's "
                                            "output: fetched only by an HTTP answer"))
        return False

    async def read(path: str, offset: int, length: int) -> bytes:
        r = await run(read_argv(path, offset, length, python))
        if not r.ok:
            raise OSError(f"{path}: {r.reason}")
        return base64.b64decode(r.stdout)

    streams.append(FetchStream(fetched, order, read, piece_bytes(kept), close))
    return True


class FetchStream:
    """A ``/run_code`` or ``/run_jupyter`` answer whose fetched files are larger than
    one command's output: its JSON written as it is read, each large file's base64
    piece by piece (one command per piece of ``piece_bytes``, a multiple of 3, so that
    the pieces' base64 texts join), so that the service holds one piece at a time.

    Args:
        fetched: what the fetching command found.
        order: the paths as the request named them (the answer's ``files`` order).
        read: reads ``length`` bytes of a file from an offset, in the sandbox (raises
            on a failure).
        piece_bytes: bytes per read.
        close: called once the answer is written, or given up (the trajectory's end).
    """

    def __init__(self, fetched: Fetched, order: list[str],
                 read: Callable[[str, int, int], Awaitable[bytes]], piece_bytes: int,
                 close: Callable[[], None]) -> None:
        self.fetched, self.order, self.read = fetched, order, read
        self.piece_bytes = max(3, piece_bytes // 3 * 3)
        self._close: Callable[[], None] | None = close

    def close(self) -> None:
        """End what the answer kept open (once; later calls do nothing)."""
        close, self._close = self._close, None
        if close is not None:
            close()

    def response(self, answer: BaseModel) -> StreamingResponse:
        """``answer`` as a streamed JSON response with the files in its ``files``
        field: the same JSON the answer holding them would be."""
        mark = uuid.uuid4().hex  # a key nothing else in the answer holds
        text = answer.model_copy(update={"files": {mark: ""}}).model_dump_json()
        head, found, tail = text.partition(f'"files":{{"{mark}":""}}')
        if not found:
            raise ValueError("the answer has no files field to fill")
        return StreamingResponse(self._body(head, tail), media_type="application/json")

    async def _body(self, head: str, tail: str) -> AsyncIterator[bytes]:
        try:
            yield (head + '"files":{').encode()
            first = True
            for path in dict.fromkeys(self.order):
                inline, size = self.fetched.files.get(path), self.fetched.large.get(path)
                if inline is None and size is None:
                    continue
                yield ("" if first else ",").encode() + to_json(path) + b':"'
                first = False
                if inline is not None:
                    yield inline.encode()
                for offset in range(0, size or 0, self.piece_bytes):
                    want = min(self.piece_bytes, size - offset)
                    data = await self.read(path, offset, want)
                    if len(data) != want:  # the file changed: no answer, not a wrong one
                        raise OSError(f"{path}: {size} bytes at the fetch, {offset + len(data)}"
                                      f" when read")
                    yield base64.b64encode(data)
                yield b'"'
            yield ("}" + tail).encode()
        except Exception as e:
            log.warning("fetch_files answer cut short: %s", e)
            raise
        finally:
            self.close()
