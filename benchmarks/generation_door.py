"""What the OpenAI front door adds per request, side by side with going direct.

One replica: ``benchmarks/openai_stub.py`` in its own process (a local HTTP server that
speaks the OpenAI format and answers at once, **not vLLM**: what is timed is the HTTP
path, not a model), or ``--replica URL --model NAME`` (a running vLLM or SGLang). The
door: one metasched-serve process on 127.0.0.1 (as deployed: its own process, the
uvicorn settings ``metasched-serve`` runs with) with ``generation`` set to the replica,
order ``predicted`` over a remaining-work predictor (fitted on made-up trajectories: the
stamp is computed for every request), each request in one of 16 trajectories
(``X-Trajectory-Id``, ``X-Task``). With ``--baseline REV`` a second door runs the
``metasched`` package as it was at git revision ``REV`` of this checkout, beside this
tree's. One client, one request at a time, the paths alternated so that the machine's
load falls on all alike, each request's whole answer read. Prints p50 and p99 (ms,
client side) of each path, streamed and not, each door's p50 overhead, its process's CPU
time per request (user and system: what the machine's load does not change), and how
many of each door's answers were byte for byte the direct one's (the stub only: a
model's answers differ between calls).

    python benchmarks/generation_door.py [--calls 400] [--warmup 20] [--chunks 16]
                                         [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from metasched.core.predictor import Predictor, TrajRecord

STUB = Path(__file__).parent / "openai_stub.py"
ROOT = Path(__file__).resolve().parents[1]


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


def free_port() -> int:
    """A free port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], probe: str, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    """A server process (``python args...``), once ``probe`` answers 200."""
    proc = subprocess.Popen([sys.executable, *args], env=env)
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(probe, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"error: {' '.join(args[:2])} did not start")
        time.sleep(0.1)


def start_stub(chunks: int) -> tuple[subprocess.Popen, str]:
    """The stub replica on a free port, once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start([str(STUB), "--port", str(port), "--chunks", str(chunks)],
                 f"{url}/health"), url


def start_door(tree: Path, replica: str) -> tuple[subprocess.Popen, str]:
    """A metasched-serve process with the ``metasched`` package of ``tree`` (a checkout's
    root) in front of ``replica``, once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return start([__file__, "--serve-door", str(port), "--replica", replica],
                 f"{url}/v1/ping", env), url


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds ``proc`` has used (user and system)."""
    t = proc.cpu_times()
    return t.user + t.system


def export(rev: str, into: Path) -> Path:
    """The ``metasched`` package as it was at git revision ``rev`` of this checkout,
    written under ``into``."""
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "metasched"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"") or str(e).encode()
        raise SystemExit(f"error: --baseline {rev}: {why.decode().strip()}") from None
    with tempfile.TemporaryFile() as f:
        f.write(tar)
        f.seek(0)
        with tarfile.open(fileobj=f) as t:
            t.extractall(into, filter="data")
    return into


def serve_door(port: int, replica: str) -> None:
    """Serve the door (the ``--serve-door`` process) until stopped."""
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.serve import ServeConfig, create_app
    from metasched.serve.server import serve

    cfg = ServeConfig(languages=[], generation={"replicas": [replica]})
    app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy"),
                                        predictor=made_up_predictor()), cfg)
    serve(app, "127.0.0.1", port, log_level="warning")


def side_by_side(http: httpx.Client, replica: str, doors: list[str], model: str,
                 max_tokens: int, stream: bool, calls: int, warmup: int
                 ) -> tuple[list[float], list[list[float]], list[int]]:
    """``calls`` requests direct and through each door (after ``warmup``), alternated:
    the times (ms) direct and through each door, and how many of each door's answers
    were the direct answer's bytes."""
    times: list[list[float]] = [[] for _ in range(len(doors) + 1)]
    same = [0] * len(doors)
    for i in range(warmup + calls):
        body = {"model": model, "prompt": [1, 2, 3, i % 997], "max_tokens": max_tokens,
                "stream": stream}
        hdr = {"X-Trajectory-Id": f"bench-{i % 16}", "X-Task": "long"}
        got = []
        for k, base in enumerate((replica, *doors)):
            t0 = time.perf_counter()
            r = http.post(base + "/v1/completions", json=body, headers=hdr)
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"error: {base}: {r.status_code} {r.text[:200]}")
            got.append(r.content)
            if i >= warmup:
                times[k].append(dt * 1e3)
        if i >= warmup:
            for k in range(len(doors)):
                same[k] += got[k + 1] == got[0]
    return times[0], times[1:], same


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
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also time the door of this git revision (e.g. main)")
    ap.add_argument("--serve-door", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_door is not None:
        serve_door(args.serve_door, args.replica)
        return

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.replica:
                replica = args.replica.rstrip("/")
            else:
                proc, replica = start_stub(args.chunks)
                procs.append(proc)
            names, doors, door_procs = [], [], []
            trees = [("door", ROOT)]
            if args.baseline:
                trees.insert(0, (f"door@{args.baseline}", export(args.baseline, Path(tmp))))
            for name, tree in trees:
                proc, url = start_door(tree, replica)
                procs.append(proc)
                names.append(name)
                doors.append(url)
                door_procs.append(psutil.Process(proc.pid))
            print(f"load before: {os.getloadavg()[0]:.1f}")
            with httpx.Client(timeout=120) as http:
                for stream in (True, False):
                    cpu0 = [cpu_s(p) for p in door_procs]
                    direct, times, same = side_by_side(http, replica, doors, args.model,
                                                       args.max_tokens, stream, args.calls,
                                                       args.warmup)
                    cpu = [(cpu_s(p) - c) * 1e3 / (args.calls + args.warmup)
                           for p, c in zip(door_procs, cpu0, strict=True)]
                    d50 = percentile(direct, 0.5)
                    print(f"{'streamed' if stream else 'not streamed'}: direct p50 "
                          f"{d50:.2f} p99 {percentile(direct, 0.99):.2f} ms")
                    for name, ts, n, c in zip(names, times, same, cpu, strict=True):
                        p50 = percentile(ts, 0.5)
                        print(f"  {name}: p50 {p50:.2f} p99 {percentile(ts, 0.99):.2f} ms; "
                              f"overhead p50 {p50 - d50:.2f} ms; CPU {c:.2f} ms a request; "
                              f"identical bytes {n}/{args.calls}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
