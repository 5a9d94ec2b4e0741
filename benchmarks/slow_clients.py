"""Slow-loris against ``metasched-serve``: does the service go on answering?

``metasched-serve`` runs as its own process with a descriptor limit of ``--nofile``
(1,024). ``--clients`` sockets (1,100) connect to it and send a request's headers one
line per second, never ending them. Meanwhile an ordinary client asks ``GET /v1/ping``
every 0.5 s (2 s timeout each). Printed (and with ``--json``, one JSON object): how many
slow sockets the service accepted, refused at once (503) and cut off (408), when; and
the ordinary client's answers over time (status counts, the first and last failure).

    python benchmarks/slow_clients.py [--clients 1100] [--nofile 1024]
        [--header-timeout-s 5] [--seconds 12] [--json] [-- extra settings ...]

Settings after ``--`` go to ``metasched-serve`` as they are (none: the service's own
defaults but ``header_timeout_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit(nofile: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    return apply


def run(clients: int, nofile: int, header_timeout_s: float | None, seconds: float,
        extra: list[str]) -> dict:
    """Run the experiment (see the module docstring); its figures."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < clients + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, clients + 1024), hard))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "metasched.cli.serve_app", f"port={port}",
                "languages=[]", "scheduler=elastic_greedy", f"hydra.run.dir={tmp}/out",
                *([f"header_timeout_s={header_timeout_s}"] if header_timeout_s else []),
                *extra]
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  preexec_fn=_limit(nofile), cwd=tmp)
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(f"{url}/v1/ping", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the service did not start: {server.stderr.read()}")
                time.sleep(0.2)
            return _attack(url, clients, seconds)
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _attack(url: str, clients: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    connect_failed = 0
    t0 = time.monotonic()
    for _ in range(clients):
        try:
            s = socket.create_connection((host, int(port)), timeout=2)
            s.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            connect_failed += 1
    ended: dict[socket.socket, tuple[float, str]] = {}
    pings: list[tuple[float, str]] = []
    next_line = next_ping = time.monotonic()
    while time.monotonic() - t0 < seconds:
        open_ = [s for s in socks if s not in ended]
        poller = select.poll()  # not select(): descriptors past 1,024
        for s in open_:
            poller.register(s, select.POLLIN)
        by_fd = {s.fileno(): s for s in open_}
        for fd, _ in poller.poll(50):
            s = by_fd[fd]
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            status = data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
            ended[s] = (time.monotonic() - t0, status)
            s.close()
        now = time.monotonic()
        if now >= next_line:
            for s in open_:
                if s not in ended:
                    try:
                        s.sendall(b"X-Slow: 1\r\n")
                    except OSError:
                        pass
            next_line = now + 1.0
        if now >= next_ping:
            t = now - t0
            try:
                pings.append((t, str(httpx.get(f"{url}/v1/ping", timeout=2).status_code)))
            except httpx.TransportError as e:
                pings.append((t, type(e).__name__))
            next_ping = time.monotonic() + 0.5
    for s in socks:
        if s not in ended:
            s.close()
    by_status: dict[str, list[float]] = {}
    for t, status in ended.values():
        by_status.setdefault(status, []).append(t)
    failed = [t for t, status in pings if status != "200"]
    return {
        "clients": clients, "connected": len(socks), "connect_failed": connect_failed,
        "still_open_at_end": len(socks) - len(ended),
        "ended": {k: {"count": len(v), "first_s": round(min(v), 2),
                      "last_s": round(max(v), 2)} for k, v in sorted(by_status.items())},
        "pings": dict(Counter(status for _, status in pings)),
        "first_ping_failure_s": round(failed[0], 2) if failed else None,
        "last_ping_failure_s": round(failed[-1], 2) if failed else None,
        "pings_ok_after_last_failure": sum(1 for t, s in pings if s == "200" and (
            not failed or t > failed[-1])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1100)
    ap.add_argument("--nofile", type=int, default=1024)
    ap.add_argument("--header-timeout-s", type=float, default=5.0,
                    help="the service's header_timeout_s (0: not set)")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("extra", nargs="*", help="more metasched-serve settings")
    a = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    out = run(a.clients, a.nofile, a.header_timeout_s or None, a.seconds, a.extra)
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
