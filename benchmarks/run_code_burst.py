"""A burst of stateless ``POST /run_code`` against ``metasched-serve``, in each isolation
mode side by side: wall time, errors, and gVisor's wall time over bubblewrap's.

For each round and each mode (in turn, so that a shared machine's load falls on all
alike), one ``metasched-serve`` is started (a process of its own on 127.0.0.1,
``elastic_greedy``, this machine's cores, ``languages=[python]``) and, once it answers,
``--n`` requests are sent at once, each ``{"language": "python", "code":
"print(6 * 7)"}`` with no trajectory (so each runs in a fresh sandbox, or a wiped one),
over ``--n`` connections. The wall time is from the first request sent to the last
answer; an error is an answer other than 200 with ``status: Success`` and ``42`` on
stdout. Modes:

- ``bwrap``: ``sandbox.isolation=bwrap``;
- ``gvisor``: ``sandbox.isolation=gvisor`` with its defaults (sandboxes wiped and
  reused, containers starting at once capped: :mod:`metasched.runtime.sandbox.warm`);
- ``gvisor-new`` (with ``--new``): ``sandbox.gvisor_reuse=false
  sandbox.gvisor_starts=1024``: a new container for each request, no cap (the design
  before reuse);
- ``gvisor-exec`` (with ``--exec``): ``sandbox.gvisor_zygote=false``: each
  ``python3`` of a request (its files' writer and its code) an exec and an interpreter
  start-up, as before the zygote.

Prints each run (wall, errors, latency p50/p99, the CPU seconds the service's process
tree spent in the burst (the service, its sandbox server, runsc's processes and the
commands: what bounds the wall time on a busy machine), the load average before it)
and, per round, gVisor's wall and CPU over bubblewrap's.

    python benchmarks/run_code_burst.py [--n 1000] [--rounds 1] [--new] [--exec]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

MODES = {
    "bwrap": ["sandbox.isolation=bwrap"],
    "gvisor": ["sandbox.isolation=gvisor"],
    "gvisor-new": ["sandbox.isolation=gvisor", "sandbox.gvisor_reuse=false",
                   "sandbox.gvisor_starts=1024"],
    "gvisor-exec": ["sandbox.isolation=gvisor", "sandbox.gvisor_zygote=false"],
}
BODY = {"language": "python", "code": "print(6 * 7)"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(mode: str, port: int, directory: str) -> subprocess.Popen:
    """Start metasched-serve in ``mode`` (its run directory under ``directory``)."""
    exe = shutil.which("metasched-serve", path=os.path.dirname(sys.executable)) or \
        "metasched-serve"
    return subprocess.Popen(
        [exe, f"port={port}", "host=127.0.0.1", "scheduler=elastic_greedy",
         "languages=[python]", f"hydra.run.dir={directory}/run", *MODES[mode]],
        cwd=directory, stdout=subprocess.DEVNULL, stderr=open(f"{directory}/stderr", "w"))


async def ready(url: str, proc: subprocess.Popen, directory: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"metasched-serve exited: "
                                 f"{Path(directory, 'stderr').read_text()[-2000:]}")
            try:
                if (await c.get(url + "/v1/status", timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"metasched-serve did not answer in {timeout_s:g} s")


async def burst(url: str, n: int) -> tuple[float, int, list[float], str]:
    """``n`` requests at once: (wall s, errors, latencies s, the first error)."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as c:
        async def one() -> tuple[float, str]:
            t0 = time.perf_counter()
            try:
                r = await c.post(url + "/run_code", json=BODY)
                body = r.json()
                ok = (r.status_code == 200 and body.get("status") == "Success"
                      and (body.get("run_result") or {}).get("stdout") == "42\n")
                why = "" if ok else f"{r.status_code} {str(body)[:300]}"
            except (httpx.HTTPError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            return time.perf_counter() - t0, why
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    errors = [why for _, why in results if why]
    return wall, len(errors), [t for t, _ in results], errors[0] if errors else ""


async def run(mode: str, n: int) -> dict:
    directory = tempfile.mkdtemp(prefix=f"run-code-burst-{mode}-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(mode, port, directory)
    try:
        await ready(url, proc, directory, 300)
        await burst(url, 4)  # (the first sandboxes and interpreters warmed)
        load = os.getloadavg()[0]
        cpu0 = tree_cpu_s(proc.pid)
        wall, errors, lat, first = await burst(url, n)
        cpu_s = tree_cpu_s(proc.pid) - cpu0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
    lat.sort()
    return {"mode": mode, "wall": wall, "errors": errors, "first_error": first,
            "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "load": load, "cpu_s": cpu_s}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of service ``pid``'s processes, those alive now and those they
    reaped: it and its descendants (its sandbox server, the commands, ``runsc``'s
    commands), and its gVisor containers' sandbox and gofer processes (``runsc``
    leaves them to init) with theirs. A container that ended meanwhile is not
    counted (with reuse, few do in a burst)."""
    total = 0.0
    mark = f"metasched-gvisor-{pid}-"
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == pid or (p.info["cmdline"] and any(
                mark in a for a in p.info["cmdline"][:3]) and p.ppid() == 1):
            roots.append(p)
    procs = {}
    for root in roots:
        try:
            for p in (root, *root.children(recursive=True)):
                procs[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    for p in procs.values():
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="requests at once")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--new", action="store_true",
                    help="also gvisor-new: a new container per request, no cap")
    ap.add_argument("--exec", action="store_true",
                    help="also gvisor-exec: no zygote (an exec per python3)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # (n connections each side)
    modes = (["bwrap", "gvisor"] + (["gvisor-new"] if args.new else [])
             + (["gvisor-exec"] if args.exec else []))
    print(f"{args.n} concurrent /run_code (python), {args.rounds} round(s); "
          f"load {os.getloadavg()[0]:.1f} at start")
    print("| round | mode | wall s | errors | p50 s | p99 s | CPU s | load (1 min) before |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    for rnd in range(1, args.rounds + 1):
        got = {}
        for mode in modes:
            r = got[mode] = asyncio.run(run(mode, args.n))
            print(f"| {rnd} | {mode} | {r['wall']:.1f} | {r['errors']} | {r['p50']:.2f} | "
                  f"{r['p99']:.2f} | {r['cpu_s']:.1f} | {r['load']:.1f} |", flush=True)
            if r["first_error"]:
                print(f"  first error: {r['first_error']}", flush=True)
        for mode in modes[1:]:
            ratios[mode].append(got[mode]["wall"] / got["bwrap"]["wall"])
            cpu_ratios[mode].append(got[mode]["cpu_s"] / max(got["bwrap"]["cpu_s"], 1e-9))
    for mode, rs in ratios.items():
        print(f"{mode} wall / bwrap wall: " + ", ".join(f"{x:.2f}" for x in rs)
              + f" (median {statistics.median(rs):.2f}); CPU / bwrap CPU: "
              + ", ".join(f"{x:.2f}" for x in cpu_ratios[mode]))


if __name__ == "__main__":
    main()
