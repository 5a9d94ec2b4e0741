"""One client's background commands against another's calls, under ``ulimit -n 1024``.

``metasched-serve`` runs with a descriptor limit of ``--nofile`` (1,024, soft and hard:
it cannot raise it) and two clients (tokens ``a`` and ``b``). Client A, through the
real ``e2b`` SDK, creates ``--sandboxes`` (10) sandboxes and starts ``--background``
(200) ``sleep 600`` in them with ``background=True``, spread evenly; then, while they
run, client B sends ``--calls`` (60) ``/run_code`` calls at once. Printed: how many of
A's commands started and how many were refused (with the first reason), and how many of
B's calls succeeded (with the first failure), the load average.

    python benchmarks/client_shares.py [--nofile 1024] [--background 200]
        [--sandboxes 10] [--calls 60] [--json] [-- extra settings ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_under_load import Service, _free_port  # noqa: E402

TOKEN_A, TOKEN_B = "a" * 16 + "-client-token", "b" * 16 + "-client-token"


async def shares(args: argparse.Namespace, work: Path) -> dict:
    import e2b

    svc = Service(_free_port(), work / "journal.db", "bwrap",
                  [f"+tokens={{a: {TOKEN_A}, b: {TOKEN_B}}}", "languages=[python]",
                   *args.extra], work / "serve.log",
                  wrap=("prlimit", f"--nofile={args.nofile}:{args.nofile}", "--"))
    out: dict = {"load_start": round(os.getloadavg()[0], 1)}
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            if await svc.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the service did not start: see {work / 'serve.log'}")
            opts = {"api_url": svc.url + "/e2b", "sandbox_url": svc.url + "/e2b",
                    "api_key": TOKEN_A}
            boxes = [await e2b.AsyncSandbox.create(**opts) for _ in range(args.sandboxes)]
            started, refused = 0, []
            handles = []
            for i in range(args.background):
                try:
                    handles.append(await boxes[i % len(boxes)].commands.run(
                        "sleep 600", background=True, timeout=0))
                    started += 1
                except Exception as e:  # noqa: BLE001 - counted, with its reason
                    refused.append(f"{type(e).__name__}: {e}"[:300])
            out.update(a_started=started, a_refused=len(refused),
                       a_reason=refused[0] if refused else None)
            body = {"code": "print('ok')", "language": "python"}
            auth = {"Authorization": f"Bearer {TOKEN_B}"}

            async def call() -> str:
                try:
                    r = await c.post(svc.url + "/run_code", json=body, headers=auth)
                except httpx.HTTPError as e:
                    return f"{type(e).__name__}: {e}"
                doc = r.json() if r.status_code == 200 else {}
                return "ok" if doc.get("status") == "Success" else f"{r.status_code} {r.text[:300]}"

            got = await asyncio.gather(*(call() for _ in range(args.calls)))
            out.update(b_ok=got.count("ok"), b_calls=len(got),
                       b_failure=next((g for g in got if g != "ok"), None))
            for sb in boxes:
                await sb.kill()
    finally:
        svc.stop()
    log = (work / "serve.log").read_text()
    out["descriptors_log"] = next((ln.split(" - ", 1)[-1] for ln in log.splitlines()
                                   if "descriptors: limit" in ln), None)
    out["load_end"] = round(os.getloadavg()[0], 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nofile", type=int, default=1024)
    p.add_argument("--background", type=int, default=200)
    p.add_argument("--sandboxes", type=int, default=10)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="settings passed to metasched-serve")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="client-shares-") as tmp:
        out = asyncio.run(shares(args, Path(tmp)))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    sys.exit(0 if out["b_ok"] == out["b_calls"] else 1)


if __name__ == "__main__":
    main()
