"""Costs of single steps on the dispatcher's per-action path, in isolation.

    .venv/bin/python benchmarks/dispatch_steps.py [--n 20000]

Prints µs per call (best of 3 ``timeit`` repeats) for: watching a pipe with asyncio's
``add_reader``/``remove_reader`` against registering it in a plain ``select.epoll``
(what ``FdWatch`` does; three descriptors per action), making and removing a scratch
directory with ``tempfile.mkdtemp`` against one exclusive ``mkdir`` (``make_workdir``),
parsing requests (a minimal cpu one, a cpu one with 13 fields, an api one with its http
spec, a job file's line: its JSON decoded too), the journal form, and a result's JSON.

The script runs against any tree that has ``parse_request``: to compare two, run it with
each tree's interpreter (or ``PYTHONPATH``) alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import tempfile
import timeit

from metasched.runtime.machine import default_workdir
from metasched.runtime.process.workdir import make_workdir
from metasched.runtime.requests import Result, parse_request

REQUEST = {"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60}
FULL = {"kind": "cpu", "argv": ["python3", "-c", "print(1)"], "timeout_s": 60,
        "trajectory": "t-17", "turn": 3, "task": "swe", "est_s": 0.5, "min_cores": 1,
        "max_cores": 4, "parallel_fraction": 0.8, "env": {"SEED": "1"},
        "mem_limit_mb": 512}
API = {"kind": "api", "endpoint": "search", "tokens": 20, "timeout_s": 30,
       "http": {"url": "http://127.0.0.1:9/search", "method": "POST", "json": {"q": "x"}}}


REPEAT = 3  # timings per row; the best is reported (--repeat)


def best_us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=REPEAT)) / n * 1e6


async def fd_watching(n: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    ep = select.epoll()
    callbacks = {}

    def asyncio_reader() -> None:
        loop.add_reader(r, print)
        loop.remove_reader(r)

    def epoll_set() -> None:
        ep.register(r, select.EPOLLIN)
        callbacks[r] = print
        del callbacks[r]
        ep.unregister(r)

    try:
        return {"asyncio add_reader + remove_reader": best_us(asyncio_reader, n),
                "epoll register + unregister": best_us(epoll_set, n)}
    finally:
        ep.close()
        os.close(r)
        os.close(w)


def main() -> None:
    global REPEAT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timings per row, the best reported (more on a loaded machine)")
    ap.add_argument("--only", default="", help="only the rows whose name contains this")
    args = ap.parse_args()
    n, REPEAT = args.n, max(1, args.repeat)
    root = default_workdir() or tempfile.gettempdir()
    req = parse_request(REQUEST)
    line = json.dumps(FULL)
    result = Result(req.id, "done", "", 0, None, "", "", 1.0, 2.0, 3.0, {"cores": [1]}, 1)
    steps = {
        f"tempfile.mkdtemp + rmdir ({root})":
            lambda: os.rmdir(tempfile.mkdtemp(prefix="metasched-", dir=root)),
        f"make_workdir + rmdir ({root})": lambda: os.rmdir(make_workdir(root)),
        "parse_request (cpu, 3 fields)": lambda: parse_request(REQUEST),
        "parse_request (cpu, 13 fields)": lambda: parse_request(FULL),
        "parse_request (api, http spec)": lambda: parse_request(API),
        "job line: json.loads + parse_request (cpu, 13 fields)":
            lambda: parse_request(json.loads(line), "jobs.jsonl:1"),
        "journal form of the request": lambda: json.dumps(
            {"queued_at": 1.0, "request": req.to_dict()}, separators=(",", ":")),
        "Result.to_json": result.to_json,
    }
    rows = asyncio.run(fd_watching(n)) if not args.only or any(
        args.only in name for name in ("asyncio add_reader + remove_reader",
                                       "epoll register + unregister")) else {}
    for name, fn in steps.items():
        if args.only in name:
            rows[name] = best_us(fn, n)
    print("| step | µs per call |")
    print("|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
