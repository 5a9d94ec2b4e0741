"""What the OpenAI front door adds per request, side by side with going direct.

One replica: ``benchmarks/openai_stub.py`` in its own process (a local HTTP server that
speaks the OpenAI format and answers at once, **not vLLM**: what is timed is the HTTP
path, not a model), or ``--replica URL --model NAME`` (a running vLLM or SGLang). One
metasched-serve on 127.0.0.1 (this process, its own thread) with ``generation`` set to
it, order ``predicted`` over a remaining-work predictor (fitted on made-up trajectories:
the stamp is computed for every request), each request in one of 16 trajectories
(``X-Trajectory-Id``, ``X-Task``). One client, one request at a time, the two paths
alternated so that the machine's load falls on both alike, each request's whole answer
read. Prints p50 and p99 (ms, client side) of each path, streamed and not, the door's
p50 overhead, and how many of the door's answers were byte for byte the direct one's
(the stub only: a model's answers differ between calls).

    python benchmarks/generation_door.py [--calls 400] [--warmup 20] [--chunks 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from metasched.core.predictor import Predictor, TrajRecord
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.serve import BackgroundServer, ServeConfig, create_app

STUB = Path(__file__).parent / "openai_stub.py"


def made_up_predictor() -> Predictor:
    """A predictor over two tasks (``long``: 10 turns of ~5 s; ``short``: one ~0.2 s)."""
    rng = np.random.default_rng(0)
    recs = [TrajRecord(task, None, tuple(("bash", s * rng.uniform(0.8, 1.2), s)
                                          for _ in range(n)))
            for _ in range(40) for task, n, s in (("long", 10, 2.0), ("short", 1, 0.1))]
    return Predictor.fit(recs)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * len(ys)) - 1))]


def start_stub(chunks: int) -> tuple[subprocess.Popen, str]:
    """The stub replica on a free port, once it answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port),
                             "--chunks", str(chunks)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("error: the stub replica did not start")
        time.sleep(0.1)


def side_by_side(http: httpx.Client, replica: str, door: str, model: str, max_tokens: int,
                 stream: bool, calls: int, warmup: int) -> tuple[list[float], list[float], int]:
    """``calls`` requests each way (after ``warmup``), alternated: the times (ms) direct
    and through the door, and how many answers were the same bytes both ways."""
    times: dict[str, list[float]] = {replica: [], door: []}
    same = 0
    for i in range(warmup + calls):
        body = {"model": model, "prompt": [1, 2, 3, i % 997], "max_tokens": max_tokens,
                "stream": stream}
        hdr = {"X-Trajectory-Id": f"bench-{i % 16}", "X-Task": "long"}
        got = []
        for base in (replica, door):
            t0 = time.perf_counter()
            r = http.post(base + "/v1/completions", json=body, headers=hdr)
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"error: {base}: {r.status_code} {r.text[:200]}")
            got.append(r.content)
            if i >= warmup:
                times[base].append(dt * 1e3)
        same += i >= warmup and got[0] == got[1]
    return times[replica], times[door], same


async def contention(door: str, model: str, low: int, out_tokens: int = 150
                     ) -> tuple[list[float], list[float]]:
    """``low`` one-turn ``short`` trajectories (``out_tokens`` each) sent through the
    door at once, then, 0.3 s later, a ``long`` trajectory's three turns (20 tokens,
    one after another): when each finished (s from the first submission)."""
    t0 = time.perf_counter()

    async def turn(http: httpx.AsyncClient, traj: str, task: str, i: int, n: int) -> float:
        body = {"model": model, "prompt": [7, 8, 9, i + 10], "max_tokens": n,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers={
                "X-Trajectory-Id": traj, "X-Task": task, "X-Turn": str(i)}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for _ in r.aiter_raw():
                pass
        return time.perf_counter() - t0

    async def high(http: httpx.AsyncClient) -> list[float]:
        await asyncio.sleep(0.3)
        return [await turn(http, "hi", "long", i, 20) for i in range(3)]

    async with httpx.AsyncClient(base_url=door, timeout=600) as http:
        *lows, hi = await asyncio.gather(
            *[turn(http, f"lo{k}", "short", 0, out_tokens) for k in range(low)], high(http))
    return lows, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per path and mode")
    ap.add_argument("--warmup", type=int, default=20, help="calls per path not counted")
    ap.add_argument("--chunks", type=int, default=16, help="the stub's output chunks")
    ap.add_argument("--replica", default=None, help="a running replica's base URL "
                    "(default: start the stub)")
    ap.add_argument("--model", default="stub", help="the model name to ask for")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    proc, replica = (None, args.replica.rstrip("/")) if args.replica else start_stub(args.chunks)
    cfg = ServeConfig(languages=[], generation={"replicas": [replica]})
    app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy"),
                                        predictor=made_up_predictor()), cfg)
    print(f"load before: {os.getloadavg()[0]:.1f}")
    try:
        with BackgroundServer(app) as srv, httpx.Client(timeout=120) as http:
            for stream in (True, False):
                direct, door, same = side_by_side(http, replica, srv.url, args.model,
                                                  args.max_tokens, stream, args.calls,
                                                  args.warmup)
                d50, p50 = percentile(direct, 0.5), percentile(door, 0.5)
                print(f"{'streamed' if stream else 'not streamed'}: direct p50 {d50:.2f} "
                      f"p99 {percentile(direct, 0.99):.2f} ms; door p50 {p50:.2f} "
                      f"p99 {percentile(door, 0.99):.2f} ms; overhead p50 "
                      f"{p50 - d50:.2f} ms; identical bytes {same}/{args.calls}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
