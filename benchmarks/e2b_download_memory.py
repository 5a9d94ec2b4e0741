"""The service's memory while E2B clients download large files.

``metasched-serve`` (bubblewrap, its defaults) serves ``--downloads`` (2) sandboxes, each
with a file of ``--mb`` (900) MB written by a command; then the real ``e2b`` SDK
downloads them all at once (``files.read(format="stream")``, each piece dropped as it
comes, so that only the service's memory grows). The service's resident memory (RSS) is
sampled every 0.2 s: printed are its value before the downloads, its peak during them
and its value 5 s after, the bytes each download got, the time taken and the load.

    python benchmarks/e2b_download_memory.py [--downloads 2] [--mb 900] [--json]
        [-- extra settings ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_under_load import Service, _free_port  # noqa: E402
from stream_memory import RssPeak  # noqa: E402

MB = 10**6


async def downloads(args: argparse.Namespace, work: Path) -> dict:
    import e2b

    svc = Service(_free_port(), work / "journal.db", "bwrap",
                  ["languages=[]", "sandbox.workspace_mb=2048", *args.extra],
                  work / "serve.log")
    out: dict = {}
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            if await svc.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the service did not start: see {work / 'serve.log'}")
            opts = {"api_url": svc.url + "/e2b", "sandbox_url": svc.url + "/e2b",
                    "api_key": "unused"}
            boxes = [await e2b.AsyncSandbox.create(timeout=3600, **opts)
                     for _ in range(args.downloads)]
            for sb in boxes:
                await sb.commands.run(f"head -c {args.mb * MB} /dev/urandom > big",
                                      timeout=600)

            async def one(sb) -> int:
                got = 0
                async for piece in await sb.files.read("big", format="stream",
                                                       request_timeout=3600):
                    got += len(piece)
                return got

            async with RssPeak(svc.proc.pid) as rss:
                await asyncio.sleep(2)
                out["rss_before_mb"] = rss.peak = rss.now()
                t0, load0 = time.monotonic(), os.getloadavg()[0]
                got = await asyncio.gather(*(one(sb) for sb in boxes))
                out["seconds"] = time.monotonic() - t0
            await asyncio.sleep(5)
            out.update(bytes=got, expected=args.mb * MB, rss_peak_mb=rss.peak,
                       rss_after_mb=rss.now(),
                       load_start=round(load0, 1), load_end=round(os.getloadavg()[0], 1))
            out["rss_rise_mb"] = out["rss_peak_mb"] - out["rss_before_mb"]
            for sb in boxes:
                await sb.kill()
    finally:
        svc.stop()
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--downloads", type=int, default=2)
    p.add_argument("--mb", type=int, default=900)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="settings passed to metasched-serve")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="e2b-download-") as tmp:
        out = asyncio.run(downloads(args, Path(tmp)))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
