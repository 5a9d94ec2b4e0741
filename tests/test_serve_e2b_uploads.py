"""E2B uploads streamed to the sandbox as they come, driven by the real ``e2b`` SDK:
``files.write`` of text, bytes and a file object (octet-stream and multipart),
``write_files``, past one writing piece; a file replaced keeps its mode and a link
is written through; over ``max_file_mb`` or cut short, refused in one line with
nothing left behind."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import time

import httpx
import pytest
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig

e2b = pytest.importorskip("e2b")
from metasched.serve.e2b.uploads import PIECE_BYTES  # noqa: E402 - needs the e2b extra

CAP_MB = 3.0  # max_file_mb here: the largest upload


@pytest.fixture(scope="module")
def served():
    # Results keep 1 MiB of output (as configs/serve.yaml): a file reads back in a few.
    dcfg = DispatcherConfig(scheduler="elastic_greedy", cores=[0, 1], tail_bytes=1 << 20)
    with serving(dcfg, ServeConfig(languages=[], max_file_mb=CAP_MB)) as s:
        yield s


@pytest.fixture
def sandbox(served):
    sb = e2b.Sandbox.create(api_url=f"{served.url}/e2b", sandbox_url=f"{served.url}/e2b",
                            api_key="unused")
    yield sb
    sb.kill()


def blob(n: int) -> bytes:
    """``n`` bytes that differ from piece to piece (a misplaced piece shows)."""
    out = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(n // 32 + 1))
    return out[:n]


def workspace(sb) -> list[str]:
    """The files in the sandbox's workspace, uploads' temporary files among them (the
    rest of the control directory, ``.e2b``, is its commands' output)."""
    found = sb.commands.run("find . -type f").stdout.split()
    return sorted(p for p in found if not p.startswith("./.e2b/") or "/up-" in p)


def settled(sb, want: list[str], within_s: float = 30.0) -> bool:
    """Whether the workspace's files come to be ``want`` within ``within_s`` (a refused
    upload's temporary files are removed in the background)."""
    deadline = time.monotonic() + within_s
    while workspace(sb) != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("kind", ["str", "bytes", "file", "file-multipart", "gzip"])
def test_an_upload_round_trips_whole_past_one_piece(sandbox, kind):
    data = blob(PIECE_BYTES * 2 + 12345)  # three writing pieces
    given = {"str": base64.b64encode(data).decode(), "bytes": data, "gzip": data,
             "file": io.BytesIO(data), "file-multipart": io.BytesIO(data)}[kind]
    extra = {"file-multipart": {"use_octet_stream": False},
             "gzip": {"gzip": True}}.get(kind, {})
    info = sandbox.files.write("up/data.bin", given, **extra)
    assert info.path == "/home/user/up/data.bin"
    want = given.encode() if kind == "str" else data
    assert bytes(sandbox.files.read("up/data.bin", format="bytes")) == want
    assert workspace(sandbox) == ["./up/data.bin"]  # nothing left in .e2b


def test_write_files_writes_each_file_small_and_large(sandbox):
    small, large = b"small", blob(PIECE_BYTES + 1)
    infos = sandbox.files.write_files([
        {"path": "a/small.txt", "data": small}, {"path": "a/large.bin", "data": large},
        {"path": "a/empty.txt", "data": b""}])
    assert [i.name for i in infos] == ["small.txt", "large.bin", "empty.txt"]
    assert bytes(sandbox.files.read("a/small.txt", format="bytes")) == small
    assert bytes(sandbox.files.read("a/large.bin", format="bytes")) == large
    assert bytes(sandbox.files.read("a/empty.txt", format="bytes")) == b""
    assert workspace(sandbox) == ["./a/empty.txt", "./a/large.bin", "./a/small.txt"]


def test_an_upload_replaces_a_file_keeping_its_mode_and_writes_through_a_link(sandbox):
    sandbox.commands.run("printf old > run.sh && chmod 755 run.sh && ln -s run.sh link")
    sandbox.files.write("link", b"#!/bin/sh\necho new\n")
    assert sandbox.commands.run("./run.sh").stdout == "new\n"
    assert sandbox.commands.run("stat -c %a run.sh; test -L link && echo link").stdout \
        == "755\nlink\n"


@pytest.mark.parametrize("streamed", [False, True])
def test_an_upload_over_max_file_mb_is_refused_in_one_line_and_leaves_nothing(
        sandbox, streamed):
    sandbox.files.write("kept.bin", b"before")
    over = int(CAP_MB * 2**20) + 1
    # a file object goes as a stream of unknown length: refused once past the cap,
    # after pieces of it were written; bytes carry their length: refused at once
    data = io.BytesIO(bytes(over)) if streamed else bytes(over)
    with pytest.raises(e2b.SandboxException) as refused:
        sandbox.files.write("kept.bin", data)
    message = str(refused.value)
    assert "request body over 3145728 bytes" in message and "\n" not in message
    assert bytes(sandbox.files.read("kept.bin", format="bytes")) == b"before"
    assert settled(sandbox, ["./kept.bin"])


def test_a_gzip_body_over_max_file_mb_once_decompressed_is_refused(sandbox):
    with pytest.raises(e2b.SandboxException, match=r"upload: more than 3145728 bytes once "
                       r"decompressed \(max_file_mb\)"):
        sandbox.files.write("bomb.bin", bytes(4 << 20), gzip=True)  # about 4 KiB sent
    assert settled(sandbox, [])


def test_a_multipart_body_cut_before_its_end_writes_nothing(served, sandbox):
    head = {"E2b-Sandbox-Id": sandbox.sandbox_id,
            "Content-Type": "multipart/form-data; boundary=XyZ"}
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cut.bin\""
            b"\r\nContent-Type: application/octet-stream\r\n\r\n" + blob(PIECE_BYTES * 2))
    r = httpx.post(f"{served.url}/e2b/files", content=body, headers=head, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "body: the multipart body ended before its last boundary"
    assert settled(sandbox, [])


def test_an_upload_that_stops_sending_is_cut_off_and_leaves_nothing():
    """A streamed body has no deadline as a whole (its pace is the writes'), but each
    piece must come within body_timeout_s: a client that stops is answered 408 and
    its connection closed."""
    with serving(DispatcherConfig(scheduler="elastic_greedy"),
                 ServeConfig(languages=[], body_timeout_s=1.0)) as srv:
        sb = e2b.Sandbox.create(api_url=f"{srv.url}/e2b", sandbox_url=f"{srv.url}/e2b",
                                api_key="unused")
        host, port = srv.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        first = blob(PIECE_BYTES + 1)  # past one piece: a temporary file is written
        sock.sendall(f"POST /e2b/files?path=stalled.bin HTTP/1.1\r\nHost: x\r\n"
                     f"E2b-Sandbox-Id: {sb.sandbox_id}\r\nContent-Type: application/"
                     f"octet-stream\r\nContent-Length: {2 * len(first)}\r\n\r\n".encode()
                     + first)
        answer = b""
        while chunk := sock.recv(65536):  # until the service closes the connection
            answer += chunk
        sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer[:300]
        assert json.loads(body)["message"] == "upload: body: no data for 1 s (body_timeout_s)"
        assert settled(sb, [])
        sb.kill()
