"""Per-cell time of E2B's code interpreter through SDK 1.x's door against SDK 2.x's
routes, side by side on one metasched-serve (127.0.0.1, in this process, with
``e2b_sdk1_ports``; ``elastic_greedy``, bubblewrap sandboxes).

Each round, in turn (the order alternating): SDK 1.x (``e2b-code-interpreter`` 1.x, in
a subprocess of ``METASCHED_E2B1_PYTHON`` with ``E2B_DEBUG=true``, driven by
``tests/e2b_sdk1_driver.py``) and SDK 2.x (this venv's, with its two URLs) each make a
sandbox, warm its kernel with one cell, then time ``--cells`` ``run_code("1")`` one by
one (client-side). Prints the p50 and p90 of each, in milliseconds, and the load.

    METASCHED_E2B1_PYTHON=/tmp/e2b1-venv/bin/python python benchmarks/e2b_sdk1.py \\
        [--rounds 5] [--cells 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.serve import BackgroundServer, ServeConfig, create_app

DRIVER = Path(__file__).resolve().parents[1] / "tests" / "e2b_sdk1_driver.py"


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * len(ys)) - 1))]


def sdk1_cells(python: str, n: int) -> list[float]:
    """Seconds of ``n`` cells through SDK 1.x (a subprocess)."""
    env = {**os.environ, "E2B_DEBUG": "true", "E2B_API_KEY": "unused"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([python, str(DRIVER), "cells", str(n)], capture_output=True,
                       text=True, env=env, timeout=600, cwd="/")
    if r.returncode:
        sys.exit(f"SDK 1.x driver failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.splitlines()[-1])["times"]


def sdk2_cells(url: str, n: int) -> list[float]:
    """Seconds of ``n`` cells through SDK 2.x (this process)."""
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(api_url=f"{url}/e2b", sandbox_url=f"{url}/e2b", api_key="unused")
    try:
        sb.run_code("1")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            assert sb.run_code("1").text == "1"
            times.append(time.perf_counter() - t0)
        return times
    finally:
        sb.kill()


def paired(url: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds of ``n`` cells through the door and ``n`` through ``/e2b``, in turn in
    one door sandbox, and their differences call by call."""
    import httpx

    body = {"code": "1", "context_id": None, "language": None, "env_vars": None}
    with httpx.Client(timeout=60) as client:
        sb = client.post("http://127.0.0.1:3000/sandboxes",
                         json={"templateID": "code-interpreter-v1"}).json()
        named = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
                 "E2b-Sandbox-Port": "49999"}
        routes = [("http://127.0.0.1:49999/execute", {}), (f"{url}/e2b/execute", named)]

        def cell(target: str, headers: dict[str, str]) -> float:
            t0 = time.perf_counter()
            r = client.post(target, json=body, headers=headers)
            assert r.status_code == 200 and '"text": "1"' in r.text, r.text
            return time.perf_counter() - t0

        try:
            cell(*routes[0])
            door, direct = [], []
            for i in range(n):
                first, second = routes if i % 2 == 0 else routes[::-1]
                a, b = cell(*first), cell(*second)
                door.append(a if i % 2 == 0 else b)
                direct.append(b if i % 2 == 0 else a)
            return door, direct, [d - e for d, e in zip(door, direct, strict=True)]
        finally:
            client.delete(f"http://127.0.0.1:3000/sandboxes/{sb['sandboxID']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", type=int, default=40)
    args = parser.parse_args()
    python = os.environ.get("METASCHED_E2B1_PYTHON")
    if not python:
        sys.exit("set METASCHED_E2B1_PYTHON to a Python with e2b-code-interpreter 1.x "
                 "(see tests/test_serve_e2b_sdk1.py)")
    app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy")),
                     ServeConfig(languages=[], e2b_sdk1_ports=True))
    one: list[float] = []
    two: list[float] = []
    print(f"load (1 min) at the start: {os.getloadavg()[0]:.1f}", flush=True)
    with BackgroundServer(app) as srv:
        for r in range(args.rounds):
            got = {}
            for which in ("1", "2") if r % 2 == 0 else ("2", "1"):
                got[which] = sdk1_cells(python, args.cells) if which == "1" else \
                    sdk2_cells(srv.url, args.cells)
            one += got["1"]
            two += got["2"]
            print(f"round {r + 1}/{args.rounds}: p50 SDK 1.x "
                  f"{statistics.median(got['1']) * 1e3:.1f} ms, SDK 2.x "
                  f"{statistics.median(got['2']) * 1e3:.1f} ms", flush=True)
        door, direct, diff = paired(srv.url, args.cells * args.rounds)
    load = os.getloadavg()[0]
    for name, xs in (("SDK 1.x (door)", one), ("SDK 2.x (/e2b)", two)):
        print(f"{name}: {len(xs)} cells, p50 {percentile(xs, 0.5) * 1e3:.1f} ms, "
              f"p90 {percentile(xs, 0.9) * 1e3:.1f} ms")
    print(f"one client, one door sandbox, {len(door)} cells each in turn: door p50 "
          f"{percentile(door, 0.5) * 1e3:.1f} ms, /e2b p50 {percentile(direct, 0.5) * 1e3:.1f}"
          f" ms, door - /e2b call by call p50 {statistics.median(diff) * 1e3:+.2f} ms")
    print(f"load (1 min) at the end: {load:.1f}")


if __name__ == "__main__":
    main()
