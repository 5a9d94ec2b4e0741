"""A burst of E2B sandbox creates on an idle ``metasched-serve``.

``--creates`` (100) ``e2b.AsyncSandbox.create`` calls at once through the real ``e2b``
SDK (its default request timeout, 60 s), against a fresh service (``--isolation``,
bubblewrap by default). Each is timed to its answer: a sandbox, a 503 with its reason,
or the SDK giving up. Then ``GET /e2b/sandboxes`` lists the live ones: a sandbox listed
that no client got is one that succeeded after its client gave up.

    python benchmarks/e2b_create_burst.py [--creates 100] [--isolation bwrap|gvisor]
        [--json] [-- extra settings ...]

Printed: how many were created, refused (503, with the first reason) and timed out;
p50 / p99 / max of the creates' times (every create, whatever its answer), of the
refusals' times, and the orphans (listed, not got); the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_under_load import Service, _free_port  # noqa: E402


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


async def burst(args: argparse.Namespace, work: Path) -> dict:
    import e2b

    svc = Service(_free_port(), work / "journal.db", args.isolation, args.extra,
                  work / "serve.log")
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            if await svc.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the service did not start: see {work / 'serve.log'}")
            opts = {"api_url": svc.url + "/e2b", "sandbox_url": svc.url + "/e2b",
                    "api_key": "unused"}

            async def one() -> tuple[str, float, str]:
                t0 = time.monotonic()
                try:
                    sb = await e2b.AsyncSandbox.create(**opts)
                    return "created", time.monotonic() - t0, sb.sandbox_id
                except e2b.TimeoutException as e:
                    return "timed out", time.monotonic() - t0, str(e)[:200]
                except e2b.ServiceBusyException as e:  # 503
                    return "refused", time.monotonic() - t0, str(e)[:300]
                except Exception as e:  # noqa: BLE001 - counted, with its reason
                    return "failed", time.monotonic() - t0, f"{type(e).__name__}: {e}"[:300]

            load0 = os.getloadavg()[0]
            got = await asyncio.gather(*(one() for _ in range(args.creates)))
            await asyncio.sleep(5)  # what else would still appear
            listed = {s["sandboxID"] for s in (await c.get(svc.url + "/e2b/sandboxes")).json()}
    finally:
        svc.stop()
    created = {sid for kind, _, sid in got if kind == "created"}
    times = [t for _, t, _ in got]
    refused = [(t, why) for kind, t, why in got if kind == "refused"]
    return {"creates": len(got), "created": len(created), "refused": len(refused),
            "timed_out": sum(k == "timed out" for k, _, _ in got),
            "failed": sum(k == "failed" for k, _, _ in got),
            "failed_reason": next((w for k, _, w in got if k == "failed"), None),
            "p50_s": _pct(times, 0.5), "p99_s": _pct(times, 0.99),
            "max_s": round(max(times), 3),
            "created_mean_s": round(statistics.mean(t for k, t, _ in got if k == "created"), 3)
            if created else None,
            "refused_max_s": round(max(t for t, _ in refused), 3) if refused else None,
            "refused_reason": refused[0][1] if refused else None,
            "orphans": len(listed - created), "load_start": round(load0, 1),
            "load_end": round(os.getloadavg()[0], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--creates", type=int, default=100)
    p.add_argument("--isolation", default="bwrap", choices=["bwrap", "gvisor"])
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="settings passed to metasched-serve")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="e2b-burst-") as tmp:
        out = asyncio.run(burst(args, Path(tmp)))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
