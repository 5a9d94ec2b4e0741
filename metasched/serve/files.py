"""``/run_code``'s files in and out of the trajectory's workspace, as ordinary commands.

The service does not reach into a sandbox: what a request brings (its code, its
``files``, its ``stdin``) is written by a small Python program run as one more ``cpu``
action of the request's trajectory, in its workspace, as the sandbox's user; what it
fetches (``fetch_files``) is read back by another, which prints the files as one JSON
object. So files go wherever the dispatcher's commands go, whichever dispatcher (or
backend) the service fronts, with the sandbox's own limits and permissions.

A command line holds at most ``ARG_MAX`` bytes (2 MiB on Linux, environment included)
and one argument at most 128 KiB, so the base64 text travels in pieces of
:data:`PIECE` characters, at most :data:`PER_COMMAND` characters per writing command
(larger inputs take several, in order, appending).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator, Mapping

__all__ = ["PER_COMMAND", "PIECE", "decoded_size", "fetch_argv", "parse_fetched", "stdin_argv",
           "write_argvs"]

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
# argv[1:] are paths; each one that is a regular file it can read goes in "files", every
# other one in "errors" with one line saying why (a missing file is left out of "files",
# as SandboxFusion does).
_FETCH = """import base64, json, os, sys
files, errors = {}, {}
for path in sys.argv[1:]:
    try:
        if not os.path.exists(path):
            errors[path] = "not found"
        elif not os.path.isfile(path):
            errors[path] = "not a regular file"
        else:
            with open(path, "rb") as f:
                files[path] = base64.b64encode(f.read()).decode()
    except (OSError, ValueError, MemoryError) as e:
        errors[path] = getattr(e, "strerror", None) or type(e).__name__
print(json.dumps({"files": files, "errors": errors}))
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


def fetch_argv(paths: list[str], python: str = "python3") -> list[str]:
    """The command that prints ``paths`` as one JSON object: ``files`` (path -> base64
    of each one it could read) and ``errors`` (path -> why not, for the others)."""
    return [python, "-c", _FETCH, *paths]


def parse_fetched(stdout: str) -> tuple[dict[str, str], dict[str, str]]:
    """What the fetching command printed: the files read (path -> base64) and, for each
    path that could not be, why (path -> one line).

    Raises:
        ValueError: it is not the whole object (cut to the output the dispatcher keeps).
    """
    try:
        doc = json.loads(stdout)
    except ValueError:
        raise ValueError(f"the fetched files are more than the {len(stdout)} bytes of "
                         f"output kept per command (the dispatcher's tail_bytes)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) \
            or not isinstance(doc.get("errors"), dict):
        raise ValueError("the fetching command printed no JSON object of files and errors")
    return ({str(k): str(v) for k, v in doc["files"].items()},
            {str(k): str(v) for k, v in doc["errors"].items()})
