"""A small HTTP server with a quota, standing in for a search or judge API: it answers
``429 Too Many Requests`` (with ``Retry-After``) to a request past ``rpm`` in the last
``window_s`` seconds, and records when each request arrived. The quota proxy's tests and
the live demonstration (``examples/agent_rollout.py``) use it on 127.0.0.1.

Run it alone with ``python -m metasched.serve.rate_limited --rpm 60 --port 9000``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit

__all__ = ["RateLimitedServer", "max_in_window"]


def max_in_window(times: list[float], window_s: float) -> int:
    """The most of ``times`` (seconds, any order) in any half-open window of
    ``window_s`` seconds."""
    ts = sorted(times)
    best = j = 0
    for i, t in enumerate(ts):
        while ts[j] <= t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best


class RateLimitedServer:
    """The server (see the module docstring), in a thread; use ``with``.

    Args:
        rpm: requests answered 200 in any ``window_s`` seconds; past them, 429.
        window_s: the quota's window (a sliding one).
        latency_s: how long each answer takes (a search API's latency).
        host, port: where it listens (port 0: a free one; ``url`` says which).

    Attributes:
        arrivals: ``time.monotonic()`` of every request, in arrival order.
        answered: the status of each, in the same order.
    """

    def __init__(self, rpm: float, *, window_s: float = 60.0, latency_s: float = 0.0,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.rpm, self.window_s, self.latency_s = rpm, window_s, latency_s
        self.arrivals: list[float] = []
        self.answered: list[int] = []
        self._ok: deque[float] = deque()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the proxy reuses connections

            def _handle(self) -> None:
                now = time.monotonic()
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                status, retry = outer._admit(now)
                if status == 200 and outer.latency_s:
                    time.sleep(outer.latency_s)
                query = parse_qs(urlsplit(self.path).query)
                doc = ({"path": urlsplit(self.path).path, "query": query,
                        "body": body.decode("utf-8", "replace")[:200]} if status == 200
                       else {"error": "rate limited"})
                data = json.dumps(doc).encode()
                # One write: headers and body in one segment (no delayed-ACK stall).
                head = (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Too Many Requests'}"
                        f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                        + (f"\r\nRetry-After: {retry:.3f}" if retry is not None else "")
                        + "\r\n\r\n").encode()
                self.wfile.write(head + data)

            do_GET = do_POST = _handle  # noqa: N815 - http.server's names

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _admit(self, now: float) -> tuple[int, float | None]:
        """200, or 429 and the seconds until the quota has room again."""
        with self._lock:
            self.arrivals.append(now)
            ok = self._ok
            while ok and ok[0] <= now - self.window_s:
                ok.popleft()
            if len(ok) >= self.rpm:
                self.answered.append(429)
                return 429, ok[0] + self.window_s - now
            ok.append(now)
            self.answered.append(200)
            return 200, None

    @property
    def rejected(self) -> int:
        """How many requests it answered 429."""
        return self.answered.count(429)

    def start(self) -> RateLimitedServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> RateLimitedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rpm", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--latency-s", type=float, default=0.0)
    p.add_argument("--port", type=int, default=9000)
    args = p.parse_args()
    with RateLimitedServer(args.rpm, window_s=args.window_s, latency_s=args.latency_s,
                           port=args.port) as srv:
        print(f"listening on {srv.url} ({args.rpm:g} requests per {args.window_s:g} s)")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
