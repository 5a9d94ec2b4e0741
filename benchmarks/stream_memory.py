"""The service's memory while clients upload large files to E2B sandboxes, or fetch
large files with ``/run_code``'s ``fetch_files``.

``metasched-serve`` (bubblewrap, its defaults) is started, then:

- ``upload``: ``--clients`` (2) E2B sandboxes, and the real ``e2b`` SDK uploads a file
  of ``--mb`` (900) MB to each at once (``files.write`` of an async iterable: the
  SDK's streamed octet-stream upload); each file's SHA-256 is then checked in its
  sandbox against the one computed as it was sent.
- ``fetch``: one ``/run_code`` request writes ``--clients`` files of ``--mb`` MB and
  fetches them all (``fetch_files``); the answer is read as it comes, each file's
  base64 decoded and hashed on the way, and checked against the SHA-256 the code
  printed.

The service's resident memory (RSS) is sampled every 0.2 s: printed are its value
before, its peak during the transfers and its value 5 s after, the time taken and
the load.

    python benchmarks/stream_memory.py upload|fetch [--clients 2] [--mb 900] [--json]
        [extra settings ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_under_load import Service, _free_port  # noqa: E402

MB = 10**6
CHUNK = 1 << 20


class RssPeak:
    """The peak resident memory (MB) of process ``pid``, sampled every 0.2 s while
    inside ``async with``."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = self.now()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        return self.proc.memory_info().rss / MB

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            await asyncio.sleep(0.2)

    async def __aenter__(self) -> RssPeak:
        self._task = asyncio.ensure_future(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, self.now())


def content(mb: int, seed: int) -> tuple[AsyncIterator[bytes], hashlib._Hash]:
    """``mb`` MB of data in 1 MiB pieces (one random piece, each numbered), and the
    hash that holds them once sent."""
    block = os.urandom(CHUNK)
    digest = hashlib.sha256()

    async def pieces() -> AsyncIterator[bytes]:
        left, n = mb * MB, 0
        while left > 0:
            piece = (seed.to_bytes(4, "big") + n.to_bytes(8, "big") + block)[:min(CHUNK, left)]
            digest.update(piece)
            left -= len(piece)
            n += 1
            yield piece

    return pieces(), digest


async def uploads(svc: Service, args: argparse.Namespace, out: dict) -> None:
    import e2b

    opts = {"api_url": svc.url + "/e2b", "sandbox_url": svc.url + "/e2b", "api_key": "unused"}
    boxes = [await e2b.AsyncSandbox.create(timeout=3600, **opts) for _ in range(args.clients)]

    async def one(i: int, sb) -> bool:
        data, digest = content(args.mb, i)
        await sb.files.write("big", data, request_timeout=3600)
        got = await sb.commands.run("sha256sum big", timeout=600)
        return got.stdout.split()[0] == digest.hexdigest()

    async with RssPeak(svc.proc.pid) as rss:
        await asyncio.sleep(2)
        out["rss_before_mb"] = rss.peak = rss.now()
        t0 = time.monotonic()
        out["whole"] = await asyncio.gather(*(one(i, sb) for i, sb in enumerate(boxes)))
        out["seconds"] = time.monotonic() - t0
    out["rss_peak_mb"] = rss.peak
    for sb in boxes:
        await sb.kill()


class FilesOfAnswer:
    """Hashes the base64 strings of a streamed ``/run_code`` answer's ``files`` as the
    answer comes; the rest of it is kept as text (``files`` left empty)."""

    MARK = b'"files":{'

    def __init__(self) -> None:
        self.text = bytearray()
        self.digests: dict[str, hashlib._Hash] = {}
        self._buf, self._state, self._name = b"", "head", ""

    def feed(self, data: bytes) -> None:
        self._buf += data
        while self._buf:
            if self._state == "head":
                at = self._buf.find(self.MARK)
                if at < 0:
                    keep = len(self.MARK) - 1
                    self.text += self._buf[:-keep]
                    self._buf = self._buf[-keep:]
                    return
                self.text += self._buf[:at + len(self.MARK)]
                self._buf, self._state = self._buf[at + len(self.MARK):], "key"
            elif self._state == "key":
                if self._buf.startswith(b"}"):
                    self._state = "tail"
                    continue
                at = self._buf.find(b'":"')
                if at < 0:
                    return
                self._name = self._buf[:at].lstrip(b',"').decode()
                self.digests[self._name] = hashlib.sha256()
                self._buf, self._state = self._buf[at + 3:], "value"
            elif self._state == "value":
                end = self._buf.find(b'"')
                cut = len(self._buf) // 4 * 4 if end < 0 else end
                self.digests[self._name].update(base64.b64decode(self._buf[:cut]))
                self._buf = self._buf[cut:] if end < 0 else self._buf[end + 1:]
                if end < 0:
                    return
                self._state = "key"
            else:
                self.text += self._buf
                self._buf = b""


async def fetches(svc: Service, args: argparse.Namespace, out: dict) -> None:
    names = [f"big{i}" for i in range(args.clients)]
    code = ("import hashlib, os\nblock = os.urandom(1 << 20)\n"
            f"for name in {names!r}:\n    h, left = hashlib.sha256(), {args.mb * MB}\n"
            "    with open(name, 'wb') as f:\n        while left > 0:\n"
            "            piece = block[:min(len(block), left)]\n"
            "            f.write(piece)\n            h.update(piece)\n"
            "            left -= len(piece)\n    print(name, h.hexdigest())\n")
    body = {"code": code, "fetch_files": names, "run_timeout": 600}
    answer = FilesOfAnswer()
    async with RssPeak(svc.proc.pid) as rss, httpx.AsyncClient(timeout=3600) as c:
        await asyncio.sleep(2)
        out["rss_before_mb"] = rss.peak = rss.now()
        t0 = time.monotonic()
        async with c.stream("POST", svc.url + "/run_code", json=body) as r:
            async for piece in r.aiter_raw():
                answer.feed(piece)
        out["seconds"] = time.monotonic() - t0
    out["rss_peak_mb"] = rss.peak
    doc = json.loads(bytes(answer.text))
    out.update(status=doc["status"], message=doc["message"][:200])
    printed = dict(line.split() for line in doc["run_result"]["stdout"].splitlines())
    out["whole"] = [answer.digests[n].hexdigest() == printed[n] if n in answer.digests
                    else doc["fetch_errors"].get(n, "missing") for n in names]


async def measure(args: argparse.Namespace, work: Path) -> dict:
    workspace_mb = args.clients * args.mb + 512
    settings = ["sandbox.workspace_mb=" + str(workspace_mb), *args.extra]
    if args.mode == "upload":
        settings.insert(0, "languages=[]")
    svc = Service(_free_port(), work / "journal.db", "bwrap", settings, work / "serve.log")
    out: dict = {"mode": args.mode, "files": args.clients, "mb": args.mb}
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            if await svc.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the service did not start: see {work / 'serve.log'}")
        load0 = os.getloadavg()[0]
        await (uploads if args.mode == "upload" else fetches)(svc, args, out)
        await asyncio.sleep(5)
        out.update(rss_after_mb=psutil.Process(svc.proc.pid).memory_info().rss / MB,
                   load_start=round(load0, 1), load_end=round(os.getloadavg()[0], 1))
        out["rss_rise_mb"] = out["rss_peak_mb"] - out["rss_before_mb"]
    finally:
        svc.stop()
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["upload", "fetch"])
    p.add_argument("--clients", type=int, default=2,
                   help="uploads at once (upload), or files fetched by one request (fetch)")
    p.add_argument("--mb", type=int, default=900)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="settings passed to metasched-serve")
    args = p.parse_intermixed_args()
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as tmp:
        out = asyncio.run(measure(args, Path(tmp)))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
